package bench

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
	"github.com/better-compute/better-compute/tests/internal/containers"
	"github.com/better-compute/better-compute/tests/internal/procs"
)

// The shared setup of the benchmarks: Postgres and NATS containers, and
// either every service as a process of its own (fleetOptions.processes,
// cluster_test.go: the benchmarks of issue 19's table) or the services in
// process (devstack) with the gateway and the controllers optionally in
// processes of their own (bin/linux, `make build`); and
// BETTER_COMPUTE_BENCH_MACHINES fakedaemon machines, in this process or in a
// fakedaemon process of their own.

func TestMain(m *testing.M) {
	code := m.Run()
	containers.Stop()
	printFigures(os.Stdout)
	os.Exit(code)
}

// machines is BETTER_COMPUTE_BENCH_MACHINES (default 1,000).
func machines() int {
	return envInt("BETTER_COMPUTE_BENCH_MACHINES", 1000)
}

// envInt is the positive integer in env var name, or def.
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// envDuration is the positive duration in env var name, or def.
func envDuration(name string, def time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// benchLogger logs the services to stderr when BETTER_COMPUTE_BENCH_LOG is set.
func benchLogger() *slog.Logger {
	if os.Getenv("BETTER_COMPUTE_BENCH_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// fleetOptions say how startFleet runs the control plane.
type fleetOptions struct {
	// processes runs every service as a process of its own (bin/linux),
	// bootstrapped with the CLI, instead of devstack; with noScheduler the
	// benchmark starts the scheduler's later (startScheduler). The other
	// options but machines are then ignored.
	processes bool
	// noScheduler starts no scheduler.
	noScheduler bool
	// machines is how many machines; machines() when 0.
	machines int
	// tickets, when non-zero, is the API's per-address burst and rate of
	// tunnel tickets (the tunnels benchmark opens hundreds from one
	// address; the default limit is 50, then 10 a second).
	tickets int
}

// fleet is a running control plane, bootstrapped, and (after
// startMachines) its machines.
type fleet struct {
	n                      int
	clk                    clock.Clock
	dbURL, natsURL, pkiDir string
	// stack is the in-process control plane (nil with processes);
	// services the processes of fleetOptions.processes.
	stack    *devstack.Stack
	services map[string]*serviceProc
	// apiURL is the public API's base URL; db the database (the stack's,
	// or the benchmark's own handle with processes); pins the deployment's.
	apiURL string
	db     *store.DB
	pins   pki.Pins
	// pgID and natsID are the containers' ids (cpu reads them once).
	pgID, natsID string
	// rootToken is the root administrator's API token; joinToken admits
	// n machines to poolID of tenantID.
	rootToken, joinToken, poolID, tenantID string
	// gatewayPID and controllersPID are their processes' (0 when they run
	// in this process).
	gatewayPID, controllersPID int
	// runner runs the machines in this process (startMachines);
	// machinesPID is the fakedaemon process running them instead
	// (startMachinesProcess), else 0.
	runner      *agent.Runner
	machinesPID int
	// machinesPprof is the fakedaemon process's profiling server's address
	// (--pprof-listen), chosen by the first of profile and
	// startMachinesProcess when BETTER_COMPUTE_BENCH_PROFILE_DIR is set;
	// "" otherwise.
	machinesPprof string
}

// startFleet starts the containers and the control plane for machines()
// machines and bootstraps it; startMachines starts the machines.
func startFleet(b *testing.B, o fleetOptions) *fleet {
	b.Helper()
	f := &fleet{n: machines(), clk: clock.New()}
	if o.machines > 0 {
		f.n = o.machines
	}
	f.dbURL = containers.Postgres(b)
	// BETTER_COMPUTE_BENCH_EMBEDDED_NATS=1 runs the benchmarks whose services
	// run in this process on devstack's NATS server, in this process too,
	// instead of a container of the local image (a machine without images).
	if o.processes || os.Getenv("BETTER_COMPUTE_BENCH_EMBEDDED_NATS") == "" {
		f.natsURL = containers.NATS(b)
	}
	f.pkiDir = b.TempDir()
	_, err := pki.Init(f.pkiDir, pki.InitOptions{GatewayNames: []string{"localhost", "127.0.0.1"}}, f.clk.Now())
	require.NoError(b, err)
	require.NoError(b, os.Chmod(f.pkiDir, 0o755))
	f.pins, err = pki.ReadPins(f.pkiDir)
	require.NoError(b, err)
	if o.processes {
		f.startProcesses(b, o.noScheduler)
		return f
	}
	opts := devstack.Options{DatabaseURL: f.dbURL, NATSURL: f.natsURL, PKIDir: f.pkiDir, Logger: benchLogger(),
		NoScheduler: o.noScheduler, TicketBurst: o.tickets, TicketRate: o.tickets}
	f.stack, err = devstack.Start(b.Context(), opts)
	require.NoError(b, err)
	b.Cleanup(func() { _ = f.stack.Close() })
	f.apiURL, f.db = f.stack.APIURL, f.stack.DB
	res, err := f.stack.Bootstrap(b.Context(), devstack.BootstrapOptions{Dir: b.TempDir(), JoinMaxUses: int32(f.n)})
	require.NoError(b, err)
	f.rootToken, f.joinToken, f.poolID, f.tenantID = res.RootToken, res.JoinToken, res.PoolID, res.TenantID
	return f
}

// machinesDir returns a new directory for the simulated machines' data
// (identities, journals), removed when the benchmark ends: in memory
// (/dev/shm) when the host has it, else b.TempDir(). Each machine fsyncs
// its identity and journal as a real one does on a disk of its own; a
// thousand of them on the benchmark host's one disk spent a third of the
// machines' process's CPU in the kernel (file creation, fsync), on the
// cores the control plane is measured on.
func machinesDir(b *testing.B) string {
	b.Helper()
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		return b.TempDir()
	}
	dir, err := os.MkdirTemp("/dev/shm", "bc-bench-machines-")
	require.NoError(b, err)
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// startMachines starts the fleet's n machines (fakedaemon's multi-machine
// mode, in this process), with durations when not nil, and returns when
// they were started; they stop when the benchmark ends.
func (f *fleet) startMachines(b *testing.B, durations *fakehw.Durations) time.Time {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	start := f.clk.Now()
	r, err := fakedaemon.Start(ctx, fakedaemon.Config{Config: agent.Config{
		Server: f.apiURL, Pins: f.pins, Token: f.joinToken, DataDir: machinesDir(b), Nodes: f.n,
		JoinConcurrency: 32,
	}, Durations: durations}, agent.Deps{})
	require.NoError(b, err)
	f.runner = r
	b.Cleanup(func() {
		cancel()
		_ = r.Wait()
	})
	return start
}

// startMachinesProcess starts the fleet's n machines in a fakedaemon
// process of their own (bin/linux/fakedaemon, `make build`; --nodes n,
// joining with the fleet's join token, the deployment's pins.json), with
// --command-durations durations when not "" and --join-concurrency
// joinConcurrency when above 0 (else the fakedaemon's default), and
// --pprof-listen machinesPprof when profiles are asked for, and returns once
// every machine has joined (its /healthz answers 200); it records the process
// id in machinesPID. The process is interrupted when the benchmark ends.
func (f *fleet) startMachinesProcess(b *testing.B, durations string, joinConcurrency int) {
	b.Helper()
	health := procs.FreeAddr(b)
	args := []string{"--nodes", strconv.Itoa(f.n), "--data-dir", machinesDir(b), "--server", f.apiURL,
		"--pins-file", filepath.Join(f.pkiDir, pki.PinsJSON), "--health-listen", health}
	if durations != "" {
		args = append(args, "--command-durations", durations)
	}
	if joinConcurrency > 0 {
		args = append(args, "--join-concurrency", strconv.Itoa(joinConcurrency))
	}
	if profileDir() != "" {
		if f.machinesPprof == "" {
			f.machinesPprof = procs.FreeAddr(b)
		}
		args = append(args, "--pprof-listen", f.machinesPprof)
	}
	p := procs.Launch(b, "fakedaemon", args, "BETTER_COMPUTE_JOIN_TOKEN="+f.joinToken, "BETTER_COMPUTE_LOG_LEVEL=warn")
	f.machinesPID = p.PID()
	p.WaitHealthy(b, health, 10*time.Minute)
}

// waitAdopted waits until every machine is adopted and has reported its
// first NodeSpec.
func (f *fleet) waitAdopted(b *testing.B) {
	b.Helper()
	eventually(b, 10*time.Minute, 100*time.Millisecond, func() (bool, string) {
		var adopted int
		err := f.db.Pool.QueryRow(b.Context(), `SELECT count(*) FROM nodes
			WHERE provision_state = 'adopted' AND observed_generation >= 1`).Scan(&adopted)
		return err == nil && adopted == f.n, fmt.Sprintf("adopted %d of %d (%v)", adopted, f.n, err)
	})
}

// eventually calls cond every tick until it returns true, and fails the
// benchmark with the last message cond returned if it did not within.
func eventually(tb testing.TB, within, tick time.Duration, cond func() (bool, string)) {
	tb.Helper()
	clk := clock.New()
	deadline := clk.Now().Add(within)
	t := clk.NewTicker(tick)
	defer t.Stop()
	for {
		done, msg := cond()
		if done {
			return
		}
		if clk.Now().After(deadline) {
			tb.Fatalf("condition not met within %s: %s", within, msg)
		}
		<-t.C()
	}
}

// nodeIDs returns the ids of the fleet's nodes, sorted.
func (f *fleet) nodeIDs(b *testing.B) []string {
	b.Helper()
	rows, err := f.db.Pool.Query(b.Context(), `SELECT id FROM nodes ORDER BY id`)
	require.NoError(b, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(b, err)
	return out
}

// bearer adds an Authorization header to every request.
type bearer struct {
	token string
	next  http.RoundTripper
}

func (t bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+t.token)
	return t.next.RoundTrip(r)
}

// apiHTTPClient is an HTTP client of the public API as root-admin that keeps
// up to conns connections open (many concurrent callers).
func (f *fleet) apiHTTPClient(conns int) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = conns, conns
	return &http.Client{Transport: bearer{token: f.rootToken, next: tr}}
}

// commandClient and eventClient are Connect clients of the public API as
// root-admin.
func (f *fleet) commandClient(hc *http.Client) computev1connect.CommandServiceClient {
	return computev1connect.NewCommandServiceClient(hc, f.apiURL+"/api/compute")
}

func (f *fleet) eventClient(hc *http.Client) computev1connect.EventServiceClient {
	return computev1connect.NewEventServiceClient(hc, f.apiURL+"/api/compute")
}

// percentiles returns the q-quantiles of ds (sorted in place), nearest rank
// below.
func percentiles(ds []time.Duration, qs ...float64) []time.Duration {
	slices.Sort(ds)
	out := make([]time.Duration, len(qs))
	if len(ds) == 0 {
		return out
	}
	for i, q := range qs {
		out[i] = ds[int(q*float64(len(ds)-1))]
	}
	return out
}

// ms is d in milliseconds, for b.ReportMetric.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// rssKiB reads a process's resident set size from /proc.
func rssKiB(tb testing.TB, pid int) int64 { return statusKiB(tb, pid, "VmRSS") }

// statusKiB reads field (VmRSS, RssAnon, RssFile, …) of a process's
// /proc/<pid>/status, in KiB.
func statusKiB(tb testing.TB, pid int, field string) int64 {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(tb, err)
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			require.NoError(tb, err)
			return n
		}
	}
	tb.Fatal("no " + field)
	return 0
}

// procCPU is the CPU time (user + system, every thread) process pid has
// used, from /proc/<pid>/stat (clock ticks of 10 ms: USER_HZ is 100 on
// Linux).
func procCPU(tb testing.TB, pid int) time.Duration {
	tb.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(tb, err)
	// The command name (field 2) may hold spaces: fields after its ')'.
	s := string(raw)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	// fields[0] is field 3 (state): utime and stime are fields 14 and 15.
	utime, err := strconv.ParseInt(fields[11], 10, 64)
	require.NoError(tb, err)
	stime, err := strconv.ParseInt(fields[12], 10, 64)
	require.NoError(tb, err)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// containerOf returns the id of the running container that publishes the
// port of rawURL (a postgres:// or nats:// URL of containers.Postgres or
// containers.NATS) on the host.
func containerOf(tb testing.TB, rawURL string) string {
	tb.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(tb, err)
	out, err := exec.Command("docker", "ps", "--no-trunc", "--format", "{{.ID}} {{.Ports}}").Output()
	require.NoError(tb, err, "docker ps")
	for _, line := range strings.Split(string(out), "\n") {
		id, ports, ok := strings.Cut(line, " ")
		if ok && strings.Contains(ports, ":"+u.Port()+"->") {
			return id
		}
	}
	tb.Fatalf("no container publishes port %s", u.Port())
	return ""
}

// containerCPU is the CPU time container id (full id) has used, read from
// its cgroup on the host (cgroup v1 cpuacct.usage or v2 cpu.stat under
// Docker's cgroupfs or systemd parents), else inside it with docker exec.
func containerCPU(tb testing.TB, id string) time.Duration {
	tb.Helper()
	for _, p := range []string{
		"/sys/fs/cgroup/cpuacct/docker/" + id + "/cpuacct.usage",
		"/sys/fs/cgroup/cpu,cpuacct/docker/" + id + "/cpuacct.usage",
		"/sys/fs/cgroup/docker/" + id + "/cpu.stat",
		"/sys/fs/cgroup/system.slice/docker-" + id + ".scope/cpu.stat",
	} {
		if raw, err := os.ReadFile(p); err == nil {
			return parseCgroupCPU(tb, string(raw))
		}
	}
	out, err := exec.Command("docker", "exec", id, "sh", "-c",
		"cat /sys/fs/cgroup/cpu.stat 2>/dev/null || cat /sys/fs/cgroup/cpuacct/cpuacct.usage").Output()
	require.NoError(tb, err, "read the CPU time of container %s", id)
	return parseCgroupCPU(tb, string(out))
}

// parseCgroupCPU reads cpuacct.usage (ns) or cpu.stat (usage_usec).
func parseCgroupCPU(tb testing.TB, s string) time.Duration {
	tb.Helper()
	s = strings.TrimSpace(s)
	if rest, ok := strings.CutPrefix(s, "usage_usec "); ok {
		us, err := strconv.ParseInt(strings.Fields(rest)[0], 10, 64)
		require.NoError(tb, err)
		return time.Duration(us) * time.Microsecond
	}
	ns, err := strconv.ParseInt(s, 10, 64)
	require.NoError(tb, err, "cgroup CPU time: %q", s)
	return time.Duration(ns)
}

// parallel calls each(i) for i in [0, total) from workers goroutines and
// returns the first error (the others still run).
func parallel(total, workers int, each func(i int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	next := make(chan int)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := each(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := range total {
		next <- i
	}
	close(next)
	wg.Wait()
	return first
}

// watchEvents streams the events of types (all when empty) after event id
// after through EventService.Watch as root-admin, calling fn with each and
// when it was received, until ctx ends. The returned channel receives the
// stream's end (nil when ctx ended it).
func (f *fleet) watchEvents(ctx context.Context, hc *http.Client, types []string, after int64,
	fn func(e *computev1.Event, at time.Time),
) <-chan error {
	done := make(chan error, 1)
	go func() {
		stream, err := f.eventClient(hc).Watch(ctx, connect.NewRequest(&computev1.WatchRequest{Types: types, AfterId: after}))
		if err != nil {
			done <- err
			return
		}
		defer stream.Close()
		for stream.Receive() {
			if e := stream.Msg().GetEvent(); e != nil {
				fn(e, f.clk.Now())
			}
		}
		if ctx.Err() != nil {
			done <- nil
			return
		}
		done <- stream.Err()
	}()
	return done
}
