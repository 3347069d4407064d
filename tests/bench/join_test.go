// Package bench holds the scale benchmarks of `make bench`. Each prints its
// figures (and reports them as benchmark metrics); none asserts a time.
package bench

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/cmd/better-compute/devstack"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
	"github.com/better-compute/better-compute/tests/internal/containers"
)

func TestMain(m *testing.M) {
	code := m.Run()
	containers.Stop()
	os.Exit(code)
}

func freeAddr(tb testing.TB) string {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer l.Close()
	return l.Addr().String()
}

// rssKiB reads a process's resident set size from /proc.
func rssKiB(tb testing.TB, pid int) int64 {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(tb, err)
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			require.NoError(tb, err)
			return n
		}
	}
	tb.Fatal("no VmRSS")
	return 0
}

func machines() int {
	if v, err := strconv.Atoi(os.Getenv("BC_BENCH_MACHINES")); err == nil && v > 0 {
		return v
	}
	return 1000
}

// startGateway runs the gateway binary (bin/linux/gateway, `make build`) as
// its own process, so that its memory can be read apart from the machines'.
func startGateway(b *testing.B, dbURL, natsURL, pkiDir string) (url string, pid int) {
	b.Helper()
	bin := filepath.Join("..", "..", "bin", "linux", "gateway")
	_, err := os.Stat(bin)
	require.NoError(b, err, "gateway binary (run make build)")
	listen, health := freeAddr(b), freeAddr(b)
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(),
		"BETTER_COMPUTE_DATABASE_URL="+dbURL,
		"BETTER_COMPUTE_NATS_URL="+natsURL,
		"BC_PKI_DIR="+pkiDir,
		"BC_LISTEN="+listen,
		"BC_HEALTH_LISTEN="+health,
		"BC_GATEWAY_ID=gw-bench",
		"BC_LOG_LEVEL=warn",
	)
	cmd.Stderr = os.Stderr
	require.NoError(b, cmd.Start())
	b.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	require.Eventually(b, func() bool {
		resp, err := http.Get("http://" + health + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 100*time.Millisecond)
	_, port, _ := net.SplitHostPort(listen)
	return "https://localhost:" + port, cmd.Process.Pid
}

// BenchmarkJoinToAdoption joins BC_BENCH_MACHINES (default 1,000) simulated
// H100 machines (fakedaemon's multi-machine mode, in this process) to the
// real services (in process, the gateway in its own process) on Postgres
// and NATS containers, and prints machines adopted per second, the p50/p99
// time from join to adoption, and the gateway's resident memory per
// connected machine. Targets on a 2-core machine: ≥ 167 adopted/s, ≤ 20 KiB
// per idle session.
func BenchmarkJoinToAdoption(b *testing.B) {
	n := machines()
	clk := clock.New()
	for range b.N {
		dbURL := containers.Postgres(b)
		natsURL := containers.NATS(b)
		pkiDir := b.TempDir()
		_, err := pki.Init(pkiDir, pki.InitOptions{GatewayNames: []string{"localhost", "127.0.0.1"}}, clk.Now())
		require.NoError(b, err)
		require.NoError(b, os.Chmod(pkiDir, 0o755))
		gwURL, gwPID := startGateway(b, dbURL, natsURL, pkiDir)

		st, err := devstack.Start(b.Context(), devstack.Options{
			DatabaseURL: dbURL, NATSURL: natsURL, PKIDir: pkiDir, ExternalGatewayURL: gwURL,
		})
		require.NoError(b, err)
		b.Cleanup(func() { _ = st.Close() })
		res, err := st.Bootstrap(b.Context(), devstack.BootstrapOptions{Dir: b.TempDir(), JoinMaxUses: int32(n)})
		require.NoError(b, err)

		rssBefore := rssKiB(b, gwPID)
		ctx, cancel := context.WithCancel(context.Background())
		start := clk.Now()
		r, err := fakedaemon.Start(ctx, fakedaemon.Config{
			Server: st.APIURL, Pins: st.Pins, Token: res.JoinToken, DataDir: b.TempDir(), Nodes: n, JoinConcurrency: 32,
		}, fakedaemon.Deps{})
		require.NoError(b, err)
		b.Cleanup(func() {
			cancel()
			_ = r.Wait()
		})

		var adopted int
		require.Eventually(b, func() bool {
			err := st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM nodes
				WHERE provision_state = 'adopted' AND observed_generation >= 1`).Scan(&adopted)
			return err == nil && adopted == n
		}, 10*time.Minute, 100*time.Millisecond, "adopted %d of %d", &adopted, n)
		wall := clk.Now().Sub(start)

		rows, err := st.DB.Pool.Query(ctx, `SELECT extract(epoch FROM adopted_at - created_at) FROM nodes`)
		require.NoError(b, err)
		lat, err := pgx.CollectRows(rows, pgx.RowTo[float64])
		require.NoError(b, err)
		slices.Sort(lat)
		p := func(q float64) time.Duration {
			return time.Duration(lat[int(q*float64(len(lat)-1))] * float64(time.Second))
		}

		var joinSpan float64
		require.NoError(b, st.DB.Pool.QueryRow(ctx,
			`SELECT extract(epoch FROM max(created_at) - min(created_at)) FROM nodes`).Scan(&joinSpan))
		fmt.Printf("joins: %d in %.1fs (%.0f/s, first to last join commit)\n", n, joinSpan, float64(n)/joinSpan)

		// Let the sessions go idle (past Welcome and the first heartbeat).
		require.NoError(b, clock.Sleep(ctx, clk, 3*time.Second))
		rssAfter := rssKiB(b, gwPID)
		perSession := float64(rssAfter-rssBefore) / float64(n)
		rate := float64(n) / wall.Seconds()

		b.ReportMetric(rate, "adopted/s")
		b.ReportMetric(float64(p(0.5).Milliseconds()), "p50-ms")
		b.ReportMetric(float64(p(0.99).Milliseconds()), "p99-ms")
		b.ReportMetric(perSession, "gw-KiB/session")
		fmt.Printf("join→adoption: %d machines in %s: %.0f adopted/s (target ≥ 167); join→adopted p50 %s, p99 %s\n",
			n, wall.Round(time.Millisecond), rate, p(0.5).Round(time.Millisecond), p(0.99).Round(time.Millisecond))
		fmt.Printf("gateway resident memory: %d KiB before, %d KiB with %d sessions: %.1f KiB per session (target ≤ 20)\n",
			rssBefore, rssAfter, n, perSession)
	}
}
