package gateway_test

// Memory per idle session. BenchmarkIdleSessionMemory runs a gateway in this
// process and N daemons (default 1000, env BETTER_COMPUTE_BENCH_SESSIONS) in
// a child process (this test binary re-executed as TestBenchClientProcess),
// so the gateway's heap and stacks are measured without the clients'. Once
// every session got its Welcome it reports, per session, the growth of
// HeapInuse+StackInuse (B/session), of HeapAlloc+StackInuse (live-B/session)
// and of goroutines:
//
//	go test -run '^$' -bench IdleSessionMemory -benchtime 1x ./services/gateway/gateway/
//
// with BETTER_COMPUTE_TEST_DATABASE_URL set (or the
// better-compute/postgres:15 image). BETTER_COMPUTE_BENCH_HEAPPROFILE=FILE
// also writes heap profiles at full sampling rate before (FILE.base) and
// after (FILE); compare them with
// `go tool pprof -diff_base FILE.base FILE`.

import (
	"bufio"
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// Environment of the client process.
const (
	benchClientEnv = "BETTER_COMPUTE_GATEWAY_BENCH_CLIENT" // directory of node-<i>.crt/.key and nodes.txt
	benchAddrEnv   = "BETTER_COMPUTE_GATEWAY_BENCH_ADDR"   // gateway host:port
	benchCAEnv     = "BETTER_COMPUTE_GATEWAY_BENCH_CA"     // serving CA file
)

// IdleSessionMemory is the result of MeasureIdleSessions: the gateway's
// growth per idle session, in a steady state (see memNow).
type IdleSessionMemory struct {
	Sessions int
	// BytesPerSession is the growth of HeapInuse+StackInuse: heap spans in
	// use (live objects plus the fragmentation around them) and stacks.
	BytesPerSession float64
	// LiveBytesPerSession is the growth of HeapAlloc+StackInuse: live
	// objects and stacks.
	LiveBytesPerSession float64
	// HeapPerSession and StackPerSession split BytesPerSession.
	HeapPerSession, StackPerSession float64
	// GoroutinesPerSession is the growth of goroutines.
	GoroutinesPerSession float64
}

// MeasureIdleSessions opens n idle sessions from a child process against a
// gateway running in this process and measures the gateway's memory growth.
func MeasureIdleSessions(tb testing.TB, n int) IdleSessionMemory {
	if os.Getenv("BETTER_COMPUTE_BENCH_HEAPPROFILE") != "" {
		runtime.MemProfileRate = 1
	}
	e := setup(tb, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: 5 * time.Second, HeartbeatInterval: time.Hour})

	dir := tb.TempDir()
	nodeIDs := make([]string, n)
	now := e.db.Now()
	var lines strings.Builder
	certRows := make([][]any, n)
	nodeRows := make([][]any, n)
	for i := range n {
		id := ids.New(ids.Node, now)
		nodeIDs[i] = id
		c := e.issue(id)
		require.NoError(tb, pki.WriteCert(filepath.Join(dir, fmt.Sprintf("node-%d.crt", i)), c.Leaf))
		require.NoError(tb, pki.WriteKey(filepath.Join(dir, fmt.Sprintf("node-%d.key", i)), c.PrivateKey.(crypto.Signer)))
		lines.WriteString(id + "\n")
		nodeRows[i] = []any{id, e.poolID, "adopted", now, now}
		certRows[i] = []any{pki.SerialHex(c.Leaf), id, pki.PublicKeySHA256(c.Leaf), c.Leaf.NotBefore, c.Leaf.NotAfter, now}
	}
	ctx := context.Background()
	_, err := e.db.Pool.CopyFrom(ctx, pgx.Identifier{"nodes"}, []string{"id", "pool_id", "provision_state", "created_at", "updated_at"}, pgx.CopyFromRows(nodeRows))
	require.NoError(tb, err)
	_, err = e.db.Pool.CopyFrom(ctx, pgx.Identifier{"node_certs"}, []string{"serial", "node_id", "public_key_sha256", "not_before", "not_after", "created_at"}, pgx.CopyFromRows(certRows))
	require.NoError(tb, err)
	require.NoError(tb, os.WriteFile(filepath.Join(dir, "nodes.txt"), []byte(lines.String()), 0o600))

	before := memNow()
	if path := os.Getenv("BETTER_COMPUTE_BENCH_HEAPPROFILE"); path != "" {
		f, err := os.Create(path + ".base")
		require.NoError(tb, err)
		require.NoError(tb, pprof.WriteHeapProfile(f))
		require.NoError(tb, f.Close())
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBenchClientProcess$", "-test.timeout=10m")
	cmd.Env = append(os.Environ(), benchClientEnv+"="+dir, benchAddrEnv+"="+g.addr,
		benchCAEnv+"="+filepath.Join(e.pkiDir, pki.ServingCACert))
	stdin, err := cmd.StdinPipe()
	require.NoError(tb, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(tb, err)
	cmd.Stderr = os.Stderr
	require.NoError(tb, cmd.Start())
	defer func() {
		stdin.Close()
		_ = cmd.Wait()
	}()
	sc := bufio.NewScanner(stdout)
	ready := false
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "ready" {
			ready = true
			break
		}
	}
	require.True(tb, ready, "client process did not get ready")
	require.Eventually(tb, func() bool { return g.srv.Sessions() == n }, time.Minute, 50*time.Millisecond)
	after := memNow()
	if path := os.Getenv("BETTER_COMPUTE_BENCH_HEAPPROFILE"); path != "" {
		f, err := os.Create(path)
		require.NoError(tb, err)
		require.NoError(tb, pprof.WriteHeapProfile(f))
		require.NoError(tb, f.Close())
	}
	per := func(a, b int64) float64 { return float64(a-b) / float64(n) }
	return IdleSessionMemory{
		Sessions:             n,
		BytesPerSession:      per(after.heapInuse+after.stack, before.heapInuse+before.stack),
		LiveBytesPerSession:  per(after.heapAlloc+after.stack, before.heapAlloc+before.stack),
		HeapPerSession:       per(after.heapInuse, before.heapInuse),
		StackPerSession:      per(after.stack, before.stack),
		GoroutinesPerSession: per(int64(after.goroutines), int64(before.goroutines)),
	}
}

type memSample struct {
	heapInuse, heapAlloc, stack int64
	goroutines                  int
}

// memNow samples memory in a steady state: after enough collections that
// idle goroutines' stacks have shrunk (each GC can halve a stack that uses
// less than a quarter of it) and sync.Pools have been emptied, as they are in
// a gateway that has been running for a few minutes.
func memNow() memSample {
	for range 8 {
		runtime.GC()
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return memSample{heapInuse: int64(ms.HeapInuse), heapAlloc: int64(ms.HeapAlloc), stack: int64(ms.StackInuse),
		goroutines: runtime.NumGoroutine()}
}

func BenchmarkIdleSessionMemory(b *testing.B) {
	n := 1000
	if v := os.Getenv("BETTER_COMPUTE_BENCH_SESSIONS"); v != "" {
		var err error
		n, err = strconv.Atoi(v)
		require.NoError(b, err)
	}
	var m IdleSessionMemory
	for b.Loop() {
		m = MeasureIdleSessions(b, n)
	}
	b.ReportMetric(m.BytesPerSession, "B/session")
	b.ReportMetric(m.LiveBytesPerSession, "live-B/session")
	b.ReportMetric(m.GoroutinesPerSession, "goroutines/session")
	b.Logf("%d idle sessions: %.1f KiB/session (heap %.1f KiB, stacks %.1f KiB; live objects and stacks %.1f KiB), %.2f goroutines/session",
		n, m.BytesPerSession/1024, m.HeapPerSession/1024, m.StackPerSession/1024, m.LiveBytesPerSession/1024, m.GoroutinesPerSession)
}

// TestBenchClientProcess is the daemons' side of MeasureIdleSessions; it
// does nothing unless run as its child.
func TestBenchClientProcess(t *testing.T) {
	dir := os.Getenv(benchClientEnv)
	if dir == "" {
		t.Skip("only runs as MeasureIdleSessions' client process")
	}
	b, err := os.ReadFile(filepath.Join(dir, "nodes.txt"))
	require.NoError(t, err)
	nodeIDs := strings.Fields(string(b))
	ca, err := pki.LoadCert(os.Getenv(benchCAEnv))
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	addr := os.Getenv(benchAddrEnv)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(nodeIDs))
	sem := make(chan struct{}, 32)
	for i, id := range nodeIDs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			cert, err := tls.LoadX509KeyPair(filepath.Join(dir, fmt.Sprintf("node-%d.crt", i)), filepath.Join(dir, fmt.Sprintf("node-%d.key", i)))
			if err != nil {
				errs <- err
				return
			}
			var p http.Protocols
			p.SetHTTP2(true)
			tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}, Protocols: &p}
			c := gatewayv1connect.NewGatewayServiceClient(&http.Client{Transport: tr}, "https://"+addr)
			s := c.Session(ctx)
			if err := s.Send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Hello{Hello: &gatewayv1.Hello{NodeId: id, BootId: "b"}}}); err != nil {
				errs <- err
				return
			}
			m, err := s.Receive()
			if err != nil {
				errs <- fmt.Errorf("%s: %w", id, err)
				return
			}
			if m.GetWelcome() == nil {
				errs <- fmt.Errorf("%s: first message is not welcome", id)
				return
			}
			// Keep the stream open and idle: read until it ends.
			go func() {
				for {
					if _, err := s.Receive(); err != nil {
						return
					}
				}
			}()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	fmt.Fprintln(os.Stdout, "ready")                  // the parent waits for this line
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // until the parent closes stdin
}
