package gateway_test

// Memory per idle session. BenchmarkIdleSessionMemory runs a gateway in this
// process and N daemons (default 1000, env BETTER_COMPUTE_BENCH_SESSIONS) in
// a child process (this test binary re-executed as TestBenchClientProcess),
// so the gateway's heap and stacks are measured without the clients'. It
// first opens one session from its own process, so that what the gateway
// builds once is not counted per session. Once every session got its
// Welcome it reports, per session, the growth of HeapInuse+StackInuse
// (B/session), of HeapAlloc+StackInuse (live-B/session), of goroutines, and
// of StackInuse right after a heartbeat on every session
// (hb-stack-B/session):
//
//	go test -run '^$' -bench IdleSessionMemory -benchtime 1x ./services/gateway/gateway/
//
// with BETTER_COMPUTE_TEST_DATABASE_URL set (or the
// better-compute/postgres:15 image). The daemons use the framed session
// transport (pkg/sessionwire), as real ones do, or Connect over HTTP/2 with
// BETTER_COMPUTE_BENCH_SESSION_TRANSPORT=connect.
// BETTER_COMPUTE_BENCH_HEAPPROFILE=FILE
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
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// Environment of the client process.
const (
	benchClientEnv = "BETTER_COMPUTE_GATEWAY_BENCH_CLIENT" // directory of node-<i>.crt/.key and nodes.txt
	benchAddrEnv   = "BETTER_COMPUTE_GATEWAY_BENCH_ADDR"   // gateway host:port
	benchCAEnv     = "BETTER_COMPUTE_GATEWAY_BENCH_CA"     // serving CA file
	// benchTransportEnv is the sessions' transport: connect (Connect over
	// HTTP/2), else framed (pkg/sessionwire, as daemons use).
	benchTransportEnv = "BETTER_COMPUTE_BENCH_SESSION_TRANSPORT"
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
	// StackAfterHeartbeat is the growth of StackInuse per session right
	// after every session sent a heartbeat and got its acknowledgement,
	// before any collection: above StackPerSession when answering a
	// heartbeat grows a session's stack.
	StackAfterHeartbeat float64
	// GoroutinesPerSession is the growth of goroutines.
	GoroutinesPerSession float64
	// OpenCPUPerSession is this process's CPU time per session while they
	// opened (TLS handshake, Hello, first delivery: the gateway's share of
	// a join), OpenXactsPerSession the database's transactions per session
	// then. BETTER_COMPUTE_BENCH_OPEN_CPUPROFILE=FILE profiles it.
	OpenCPUPerSession   time.Duration
	OpenXactsPerSession float64
}

// MeasureIdleSessions opens n idle sessions from a child process against a
// gateway running in this process and measures the gateway's memory growth.
func MeasureIdleSessions(tb testing.TB, n int) IdleSessionMemory {
	if os.Getenv("BETTER_COMPUTE_BENCH_HEAPPROFILE") != "" {
		runtime.MemProfileRate = 1
	}
	f := startBenchFleet(tb, n, gateway.Config{ResyncInterval: 5 * time.Second, HeartbeatInterval: time.Hour})
	after := memNow()
	if path := os.Getenv("BETTER_COMPUTE_BENCH_HEAPPROFILE"); path != "" {
		out, err := os.Create(path)
		require.NoError(tb, err)
		require.NoError(tb, pprof.WriteHeapProfile(out))
		require.NoError(tb, out.Close())
	}
	// A heartbeat on every session, with no collection after it: a
	// goroutine whose stack the heartbeat's calls outgrow keeps twice it
	// until the next collections shrink it back.
	f.burst(tb, 1)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	before := f.before
	per := func(a, b int64) float64 { return float64(a-b) / float64(n) }
	return IdleSessionMemory{
		StackAfterHeartbeat:  per(int64(ms.StackInuse), before.stack),
		Sessions:             n,
		BytesPerSession:      per(after.heapInuse+after.stack, before.heapInuse+before.stack),
		LiveBytesPerSession:  per(after.heapAlloc+after.stack, before.heapAlloc+before.stack),
		HeapPerSession:       per(after.heapInuse, before.heapInuse),
		StackPerSession:      per(after.stack, before.stack),
		GoroutinesPerSession: per(int64(after.goroutines), int64(before.goroutines)),
		OpenCPUPerSession:    time.Duration(per(f.openCPU.Nanoseconds(), 0)),
		OpenXactsPerSession:  per(f.openXacts, 0),
	}
}

// benchFleet is a gateway in this process with n sessions open from a child
// process (TestBenchClientProcess), which takes commands on its stdin.
type benchFleet struct {
	e      *env
	g      *gw
	n      int
	before memSample // before the sessions opened
	// openCPU is this process's CPU time while the sessions opened (TLS
	// handshakes, Hello, first delivery), openXacts the database's
	// transactions then (each is a statement or more).
	openCPU   time.Duration
	openXacts int64
	stdin     io.WriteCloser
	stdout    *bufio.Scanner
}

// startBenchFleet inserts n adopted nodes with certificates, runs a gateway
// with cfg and opens a session for each node from a child process; it
// returns once the gateway holds all n. The child ends with the test.
func startBenchFleet(tb testing.TB, n int, cfg gateway.Config) *benchFleet {
	e := setup(tb, options{})
	// The metrics pipeline of the binary's default (Prometheus), whose
	// instruments every heartbeat updates.
	m, err := telemetry.NewMetrics(context.Background(), telemetry.ExporterPrometheus, "gateway")
	require.NoError(tb, err)
	e.metrics = m
	g := e.startGateway(cfg)

	dir := tb.TempDir()
	now := e.db.Now()
	var lines strings.Builder
	certRows := make([][]any, n)
	nodeRows := make([][]any, n)
	for i := range n {
		id := ids.New(ids.Node, now)
		c := e.issue(id)
		require.NoError(tb, pki.WriteCert(filepath.Join(dir, fmt.Sprintf("node-%d.crt", i)), c.Leaf))
		require.NoError(tb, pki.WriteKey(filepath.Join(dir, fmt.Sprintf("node-%d.key", i)), c.PrivateKey.(crypto.Signer)))
		lines.WriteString(id + "\n")
		nodeRows[i] = []any{id, e.poolID, "adopted", now, now}
		certRows[i] = []any{pki.SerialHex(c.Leaf), id, pki.PublicKeySHA256(c.Leaf), c.Leaf.NotBefore, c.Leaf.NotAfter, now}
	}
	ctx := context.Background()
	_, err = e.db.Pool.CopyFrom(ctx, pgx.Identifier{"nodes"}, []string{"id", "pool_id", "provision_state", "created_at", "updated_at"}, pgx.CopyFromRows(nodeRows))
	require.NoError(tb, err)
	_, err = e.db.Pool.CopyFrom(ctx, pgx.Identifier{"node_certs"}, []string{"serial", "node_id", "public_key_sha256", "not_before", "not_after", "created_at"}, pgx.CopyFromRows(certRows))
	require.NoError(tb, err)
	require.NoError(tb, os.WriteFile(filepath.Join(dir, "nodes.txt"), []byte(lines.String()), 0o600))

	// One session first, from this process, so that what the gateway
	// builds once, at its first session (the compiled rules of the
	// messages, prepared statements, protobuf descriptors), is not counted
	// per session.
	warm, _ := e.connect(g, e.newNode(), nil)
	warm.heartbeat(1, 0)
	warm.nextAck()

	f := &benchFleet{e: e, g: g, n: n}
	f.before = memNow()
	db0 := f.dbNow(tb)
	stop := startProfile(tb, "BETTER_COMPUTE_BENCH_OPEN_CPUPROFILE")
	c0 := cpuNow(tb)
	if path := os.Getenv("BETTER_COMPUTE_BENCH_HEAPPROFILE"); path != "" {
		out, err := os.Create(path + ".base")
		require.NoError(tb, err)
		require.NoError(tb, pprof.WriteHeapProfile(out))
		require.NoError(tb, out.Close())
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBenchClientProcess$", "-test.timeout=30m")
	cmd.Env = append(os.Environ(), benchClientEnv+"="+dir, benchAddrEnv+"="+g.addr,
		benchCAEnv+"="+filepath.Join(e.pkiDir, pki.ServingCACert))
	f.stdin, err = cmd.StdinPipe()
	require.NoError(tb, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(tb, err)
	cmd.Stderr = os.Stderr
	require.NoError(tb, cmd.Start())
	tb.Cleanup(func() {
		f.stdin.Close()
		_ = cmd.Wait()
	})
	f.stdout = bufio.NewScanner(stdout)
	f.await(tb, "ready")
	require.Eventually(tb, func() bool { return g.srv.Sessions() == n+1 }, time.Minute, 50*time.Millisecond) // and the warm one
	f.openCPU = cpuNow(tb) - c0
	stop()
	f.openXacts = f.dbNow(tb).xacts - db0.xacts
	return f
}

// await reads the child's output up to the line want.
func (f *benchFleet) await(tb testing.TB, want string) {
	tb.Helper()
	for f.stdout.Scan() {
		if strings.TrimSpace(f.stdout.Text()) == want {
			return
		}
	}
	tb.Fatalf("client process ended before it printed %q", want)
}

// burst has every session send k heartbeats, each after the previous one's
// acknowledgement, and waits for the last.
func (f *benchFleet) burst(tb testing.TB, k int) {
	tb.Helper()
	_, err := fmt.Fprintf(f.stdin, "burst %d\n", k)
	require.NoError(tb, err)
	f.await(tb, "done")
}

// pace has every session send a heartbeat every d from now on, each at its
// own phase, as idle daemons do.
func (f *benchFleet) pace(tb testing.TB, d time.Duration) {
	tb.Helper()
	_, err := fmt.Fprintf(f.stdin, "pace %d\n", d.Nanoseconds())
	require.NoError(tb, err)
	f.await(tb, "pacing")
}

// dbCounters are Postgres's cumulative counters of the test database:
// transactions, and rows of nodes updated.
type dbCounters struct{ xacts, nodeUpdates int64 }

// dbNow reads dbCounters once the other backends have reported theirs
// (each does within about a second of its last transaction).
func (f *benchFleet) dbNow(tb testing.TB) dbCounters {
	tb.Helper()
	require.NoError(tb, clock.Sleep(context.Background(), realClock, 1500*time.Millisecond))
	var c dbCounters
	err := f.e.db.Pool.QueryRow(context.Background(), `
		select (select xact_commit + xact_rollback from pg_stat_database where datname = current_database()),
		       (select n_tup_upd from pg_stat_user_tables where relname = 'nodes')`).Scan(&c.xacts, &c.nodeUpdates)
	require.NoError(tb, err)
	return c
}

// startCPUProfile starts a CPU profile into BETTER_COMPUTE_BENCH_CPUPROFILE
// when it is set, and returns what stops it.
func startCPUProfile(tb testing.TB) func() {
	return startProfile(tb, "BETTER_COMPUTE_BENCH_CPUPROFILE")
}

// startProfile starts a CPU profile into the file the environment variable
// env names, when it is set, and returns what stops it.
func startProfile(tb testing.TB, env string) func() {
	path := os.Getenv(env)
	if path == "" {
		return func() {}
	}
	out, err := os.Create(path)
	require.NoError(tb, err)
	require.NoError(tb, pprof.StartCPUProfile(out))
	return func() { pprof.StopCPUProfile(); _ = out.Close() }
}

// cpuNow is the CPU time this process has used, user and system.
func cpuNow(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	require.NoError(tb, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// gcCPUNow is the CPU time, in seconds, this process's garbage collector
// has used (runtime/metrics /cpu/classes/gc/total:cpu-seconds, an
// estimate the runtime keeps).
func gcCPUNow() float64 {
	s := []metrics.Sample{{Name: "/cpu/classes/gc/total:cpu-seconds"}}
	metrics.Read(s)
	return s[0].Value.Float64()
}

// switchesNow is how many times this process's threads gave up the CPU,
// voluntarily (a thread parked: nothing left to run) or not.
func switchesNow(tb testing.TB) int64 {
	var ru syscall.Rusage
	require.NoError(tb, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return ru.Nvcsw + ru.Nivcsw
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

// TestIdleSessionMemory bounds what an idle framed session holds in the
// gateway, measured as BenchmarkIdleSessionMemory does, over 200 sessions:
// one goroutine, whose stack the runtime shrinks to 4 KiB (idleStackBytes),
// and at most liveHeapPerSession bytes of live objects.
func TestIdleSessionMemory(t *testing.T) {
	m := MeasureIdleSessions(t, 200)
	t.Logf("per idle session: %.0f B of live objects, %.0f B of stack (%.0f B right after a heartbeat), %.2f goroutines",
		m.LiveBytesPerSession-m.StackPerSession, m.StackPerSession, m.StackAfterHeartbeat, m.GoroutinesPerSession)
	require.InDelta(t, 1, m.GoroutinesPerSession, 0.02, "one goroutine per session")
	// Stacks are counted in spans of several stacks, and each P caches
	// some: allow a little over the stack itself.
	require.LessOrEqual(t, m.StackPerSession, float64(idleStackBytes)*1.25, "an idle session's stack")
	require.LessOrEqual(t, m.StackAfterHeartbeat, float64(idleStackBytes)*1.25, "an idle session's stack, right after a heartbeat")
	require.LessOrEqual(t, m.LiveBytesPerSession-m.StackPerSession, float64(liveHeapPerSession), "an idle session's live objects")
}

// liveHeapPerSession bounds the live objects of an idle framed session:
// nearly all crypto/tls's (the connection, its read and handshake buffers,
// the client certificate, the AEAD states).
const liveHeapPerSession = 15 << 10

func BenchmarkIdleSessionMemory(b *testing.B) {
	n := benchSessions(b)
	var m IdleSessionMemory
	for b.Loop() {
		m = MeasureIdleSessions(b, n)
	}
	b.ReportMetric(m.BytesPerSession, "B/session")
	b.ReportMetric(m.LiveBytesPerSession, "live-B/session")
	b.ReportMetric(m.GoroutinesPerSession, "goroutines/session")
	b.ReportMetric(m.StackAfterHeartbeat, "hb-stack-B/session")
	b.ReportMetric(float64(m.OpenCPUPerSession.Nanoseconds()), "open-cpu-ns/session")
	b.ReportMetric(m.OpenXactsPerSession, "open-xacts/session")
	b.Logf("%d idle sessions: %.1f KiB/session (heap %.1f KiB, stacks %.1f KiB; live objects and stacks %.1f KiB), %.2f goroutines/session",
		n, m.BytesPerSession/1024, m.HeapPerSession/1024, m.StackPerSession/1024, m.LiveBytesPerSession/1024, m.GoroutinesPerSession)
}

func benchSessions(tb testing.TB) int {
	n := 1000
	if v := os.Getenv("BETTER_COMPUTE_BENCH_SESSIONS"); v != "" {
		var err error
		n, err = strconv.Atoi(v)
		require.NoError(tb, err)
	}
	return n
}

// BenchmarkHeartbeat measures what one heartbeat costs the gateway: n
// sessions (BETTER_COMPUTE_BENCH_SESSIONS, 1000) open from a child process,
// each sends BETTER_COMPUTE_BENCH_HEARTBEATS (20) heartbeats, one after the
// other's acknowledgement, all sessions at once; per heartbeat it reports
// this process's CPU time (cpu-ns/heartbeat: the gateway, the embedded NATS
// server), its allocations (allocs/heartbeat, B/heartbeat), and the
// database's transactions (xacts/heartbeat) and nodes rows updated
// (node-updates/heartbeat) while they ran, resync and last_seen flushes
// included, and the context switches of its threads (ctxsw/heartbeat: a
// count, steadier than CPU time on a shared machine):
//
//	go test -run '^$' -bench Heartbeat -benchtime 1x ./gateway/
//
// BETTER_COMPUTE_BENCH_CPUPROFILE=FILE writes a CPU profile of the bursts;
// BETTER_COMPUTE_BENCH_MEMPROFILE=FILE allocation profiles before
// (FILE.base) and after them (`go tool pprof -sample_index=alloc_objects
// -diff_base FILE.base FILE`).
func BenchmarkHeartbeat(b *testing.B) {
	n := benchSessions(b)
	k := 20
	if v := os.Getenv("BETTER_COMPUTE_BENCH_HEARTBEATS"); v != "" {
		var err error
		k, err = strconv.Atoi(v)
		require.NoError(b, err)
	}
	memProfile := os.Getenv("BETTER_COMPUTE_BENCH_MEMPROFILE")
	if memProfile != "" {
		runtime.MemProfileRate = 64
	}
	f := startBenchFleet(b, n, gateway.Config{HeartbeatInterval: time.Hour})
	writeHeap := func(path string) {
		if memProfile != "" {
			runtime.GC()
			out, err := os.Create(path)
			require.NoError(b, err)
			require.NoError(b, pprof.Lookup("allocs").WriteTo(out, 0))
			require.NoError(b, out.Close())
		}
	}
	writeHeap(memProfile + ".base")
	defer writeHeap(memProfile)
	defer startCPUProfile(b)()
	var cpu time.Duration
	var allocs, bytes uint64
	var switches int64
	var db dbCounters
	beats := 0
	for b.Loop() {
		db0 := f.dbNow(b)
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		c0, s0 := cpuNow(b), switchesNow(b)
		f.burst(b, k)
		cpu += cpuNow(b) - c0
		switches += switchesNow(b) - s0
		runtime.ReadMemStats(&m1)
		allocs += m1.Mallocs - m0.Mallocs
		bytes += m1.TotalAlloc - m0.TotalAlloc
		db1 := f.dbNow(b)
		db.xacts += db1.xacts - db0.xacts
		db.nodeUpdates += db1.nodeUpdates - db0.nodeUpdates
		beats += n * k
	}
	per := func(v float64) float64 { return v / float64(beats) }
	b.ReportMetric(per(float64(cpu.Nanoseconds())), "cpu-ns/heartbeat")
	b.ReportMetric(per(float64(allocs)), "allocs/heartbeat")
	b.ReportMetric(per(float64(switches)), "ctxsw/heartbeat")
	b.ReportMetric(per(float64(bytes)), "B/heartbeat")
	b.ReportMetric(per(float64(db.xacts)), "xacts/heartbeat")
	b.ReportMetric(per(float64(db.nodeUpdates)), "node-updates/heartbeat")
	b.Logf("%d heartbeats on %d sessions: %.1f µs CPU, %.1f allocations, %.0f B each; %d transactions, %d nodes rows updated",
		beats, n, per(float64(cpu.Nanoseconds()))/1e3, per(float64(allocs)), per(float64(bytes)), db.xacts, db.nodeUpdates)
}

// BenchmarkIdleSessionCPU measures what n idle sessions
// (BETTER_COMPUTE_BENCH_SESSIONS, 1000), each sending a heartbeat every
// 10 s, cost the gateway: this process's CPU time over
// BETTER_COMPUTE_BENCH_IDLE_WINDOW (30 s) as a share of one core
// (cpu-%core, and per 1,000 sessions; gc-cpu-%core its garbage
// collector's share, which GOGC sets), its allocations and its threads'
// context switches per second, and the database's transactions and nodes
// rows updated per second:
//
//	go test -run '^$' -bench IdleSessionCPU -benchtime 1x ./gateway/
//
// BETTER_COMPUTE_BENCH_CPUPROFILE=FILE writes a CPU profile of the window.
func BenchmarkIdleSessionCPU(b *testing.B) {
	n := benchSessions(b)
	window := 30 * time.Second
	if v := os.Getenv("BETTER_COMPUTE_BENCH_IDLE_WINDOW"); v != "" {
		var err error
		window, err = time.ParseDuration(v)
		require.NoError(b, err)
	}
	const interval = 10 * time.Second
	for b.Loop() {
		f := startBenchFleet(b, n, gateway.Config{HeartbeatInterval: interval})
		f.pace(b, interval)
		require.NoError(b, clock.Sleep(b.Context(), realClock, interval)) // every session's first heartbeat
		db0 := f.dbNow(b)
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		stop := startCPUProfile(b)
		c0, s0, gc0 := cpuNow(b), switchesNow(b), gcCPUNow()
		require.NoError(b, clock.Sleep(b.Context(), realClock, window))
		cpu, switches, gcCPU := cpuNow(b)-c0, switchesNow(b)-s0, gcCPUNow()-gc0
		stop()
		runtime.ReadMemStats(&m1)
		db1 := f.dbNow(b)
		pct := 100 * cpu.Seconds() / window.Seconds()
		b.ReportMetric(pct, "cpu-%core")
		b.ReportMetric(pct*1000/float64(n), "cpu-%core/1000")
		b.ReportMetric(100*gcCPU/window.Seconds(), "gc-cpu-%core")
		b.ReportMetric(float64(m1.Mallocs-m0.Mallocs)/window.Seconds(), "allocs/s")
		b.ReportMetric(float64(switches)/window.Seconds(), "ctxsw/s")
		b.ReportMetric(float64(db1.xacts-db0.xacts)/window.Seconds(), "xacts/s")
		b.ReportMetric(float64(db1.nodeUpdates-db0.nodeUpdates)/window.Seconds(), "node-updates/s")
	}
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
	var mu sync.Mutex
	var clients []benchSession
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
			cfg := &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}
			var s clientStream
			if os.Getenv(benchTransportEnv) == "connect" {
				var p http.Protocols
				p.SetHTTP2(true)
				tr := &http.Transport{TLSClientConfig: cfg, Protocols: &p}
				s = gatewayv1connect.NewGatewayServiceClient(&http.Client{Transport: tr}, "https://"+addr).Session(ctx)
			} else {
				s = sessionwire.NewClientStream(ctx, nil, addr, cfg, service.MaxMessageBytes)
			}
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
			// Keep the stream open and idle: read until it ends, passing
			// heartbeat acknowledgements on.
			acks := make(chan struct{}, 1)
			go func() {
				for {
					m, err := s.Receive()
					if err != nil {
						return
					}
					if m.GetHeartbeatAck() != nil {
						select {
						case acks <- struct{}{}:
						default:
						}
					}
				}
			}()
			mu.Lock()
			clients = append(clients, benchSession{s: s, acks: acks})
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	fmt.Fprintln(os.Stdout, "ready") // the parent waits for this line
	// Each line "burst K" makes every session send K heartbeats, one at a
	// time (each waiting for its acknowledgement), all sessions at once;
	// then "done" is printed. The parent closing stdin ends the process.
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var k int
		var ns int64
		if _, err := fmt.Sscanf(in.Text(), "pace %d", &ns); err == nil {
			d := time.Duration(ns)
			for i, c := range clients {
				go func() {
					// Phases spread over d, as daemons' are.
					t := realClock.NewTimer(d * time.Duration(i) / time.Duration(len(clients)))
					defer t.Stop()
					for seq := int64(1); ; seq++ {
						select {
						case <-ctx.Done():
							return
						case <-t.C():
						}
						if err := c.s.Send(daemonHeartbeat(seq)); err != nil {
							return
						}
						t.Reset(d)
					}
				}()
			}
			fmt.Fprintln(os.Stdout, "pacing")
			continue
		}
		if _, err := fmt.Sscanf(in.Text(), "burst %d", &k); err != nil {
			continue
		}
		var bwg sync.WaitGroup
		for _, c := range clients {
			bwg.Go(func() {
				for seq := range k {
					if err := c.s.Send(daemonHeartbeat(int64(seq + 1))); err != nil {
						return
					}
					t := realClock.NewTimer(10 * time.Second)
					select {
					case <-c.acks:
					case <-t.C():
					}
					t.Stop()
				}
			})
		}
		bwg.Wait()
		fmt.Fprintln(os.Stdout, "done")
	}
}

// daemonHeartbeat is heartbeat seq as daemons send it (pkg/daemon), with
// their observed generation and the time it was sent.
func daemonHeartbeat(seq int64) *gatewayv1.SessionRequest {
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{
		Seq: seq, ObservedGeneration: 1, SentAt: timestamppb.New(realClock.Now())}}}
}

// benchSession is one of the client process's sessions.
type benchSession struct {
	s    clientStream
	acks chan struct{}
}
