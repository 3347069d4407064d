package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/bootstrap"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/tests/internal/procs"
)

// The control plane as processes: every service of bin/linux (`make build`)
// in a process of its own, bootstrapped by `better-compute bootstrap` as
// compose's one-shot does, so that each one's CPU (/proc/<pid>/stat) and
// memory are read apart from the callers' (this process) and the machines'
// (a fakedaemon process).

// Service names, in the order they start and print.
const (
	svcJoinService = "joinservice"
	svcGateway     = "gateway"
	svcAPI         = "api"
	svcControllers = "controllers"
	svcScheduler   = "scheduler"
)

// serviceNames are the control plane's services.
var serviceNames = []string{svcAPI, svcJoinService, svcGateway, svcScheduler, svcControllers}

// serviceProc is a service running as a process.
type serviceProc struct {
	name string
	proc *procs.Proc
	// metrics is its GET /metrics URL; pprof its profiling server's
	// address ("" unless BETTER_COMPUTE_BENCH_PROFILE_DIR is set).
	metrics, pprof string
}

// profileDir is BETTER_COMPUTE_BENCH_PROFILE_DIR: where the services' CPU
// profiles of each benchmark's saturated phase go ("" for none).
func profileDir() string { return os.Getenv("BETTER_COMPUTE_BENCH_PROFILE_DIR") }

// startProcesses runs the whole control plane as processes on the fleet's
// database and NATS (startFleet made them and the PKI): JoinService, the
// gateway, the API and the controllers, and the scheduler unless
// noScheduler (startScheduler starts it later); then bootstraps the
// deployment with the CLI and opens f.db for the benchmark's own queries.
func (f *fleet) startProcesses(b *testing.B, noScheduler bool) {
	b.Helper()
	f.services = map[string]*serviceProc{}
	common := []string{
		"BETTER_COMPUTE_NATS_URL=" + f.natsURL,
		"BETTER_COMPUTE_PKI_DIR=" + f.pkiDir,
		"BETTER_COMPUTE_LOG_LEVEL=warn",
	}
	joinListen, joinControl, gwListen, gwHealth := procs.FreeAddr(b), procs.FreeAddr(b), procs.FreeAddr(b), procs.FreeAddr(b)
	_, gwPort, _ := net.SplitHostPort(gwListen)
	gatewayURL := "https://localhost:" + gwPort
	// Every simulated machine joins from this host: no per-address join
	// limit (devstack's too).
	f.startService(b, svcJoinService, joinListen, "http://"+joinListen+"/metrics", append(common,
		"BETTER_COMPUTE_LISTEN="+joinListen, "BETTER_COMPUTE_CONTROL_LISTEN="+joinControl,
		"BETTER_COMPUTE_GATEWAY_URL="+gatewayURL, "BETTER_COMPUTE_GATEWAY_SERVER_NAME=localhost",
		"BETTER_COMPUTE_JOIN_BURST=1048576", "BETTER_COMPUTE_JOIN_RATE=1048576")...)
	f.startService(b, svcGateway, gwHealth, "http://"+gwHealth+"/metrics", append(common,
		"BETTER_COMPUTE_LISTEN="+gwListen, "BETTER_COMPUTE_HEALTH_LISTEN="+gwHealth,
		"BETTER_COMPUTE_GATEWAY_ID=gw-bench", "BETTER_COMPUTE_GATEWAY_JOINSERVICE_URL=https://"+joinControl)...)
	apiListen := procs.FreeAddr(b)
	f.startService(b, svcAPI, apiListen, "http://"+apiListen+"/metrics", append(common,
		"BETTER_COMPUTE_LISTEN="+apiListen, "BETTER_COMPUTE_JOIN_URL=http://"+joinListen,
		"BETTER_COMPUTE_GATEWAY_URL="+gatewayURL, "BETTER_COMPUTE_GATEWAY_SERVER_NAME=localhost")...)
	f.apiURL = "http://" + apiListen
	health := procs.FreeAddr(b)
	f.startService(b, svcControllers, health, "http://"+health+"/metrics", append(common,
		"BETTER_COMPUTE_HEALTH_LISTEN="+health, "BETTER_COMPUTE_LEASE_HOLDER=bench-controllers")...)
	if !noScheduler {
		f.startScheduler(b)
	}
	f.gatewayPID, f.controllersPID = f.services[svcGateway].proc.PID(), f.services[svcControllers].proc.PID()

	// Bootstrap as compose's one-shot does: the root tenant and token, a
	// site, a pool accepting 8x H100 and a join token for n machines.
	dir := b.TempDir()
	tokenFile, envFile := filepath.Join(dir, "join-token"), filepath.Join(dir, "root.env")
	out, err := exec.Command(procs.Binary(b, "better-compute"), "bootstrap", "--database-url", f.dbURL,
		"--join-max-uses", strconv.Itoa(f.n), "--join-token-file", tokenFile, "--env-file", envFile).CombinedOutput()
	require.NoError(b, err, "better-compute bootstrap: %s", out)
	env := readExports(b, envFile)
	f.tenantID, f.rootToken, f.poolID = env[bootstrap.EnvTenant], env[bootstrap.EnvToken], env[bootstrap.EnvPool]
	token, err := os.ReadFile(tokenFile)
	require.NoError(b, err)
	f.joinToken = strings.TrimSpace(string(token))
	require.NotEmpty(b, f.rootToken)
	require.NotEmpty(b, f.joinToken)

	f.db, err = store.Open(b.Context(), f.dbURL, f.clk, 30*time.Second, store.Options{MaxConns: 4})
	require.NoError(b, err)
	b.Cleanup(f.db.Close)
}

// startScheduler runs the scheduler as a process and waits until it is
// ready.
func (f *fleet) startScheduler(b *testing.B) {
	b.Helper()
	health := procs.FreeAddr(b)
	f.startService(b, svcScheduler, health, "http://"+health+"/metrics",
		"BETTER_COMPUTE_NATS_URL="+f.natsURL,
		"BETTER_COMPUTE_PKI_DIR="+f.pkiDir, "BETTER_COMPUTE_LOG_LEVEL=warn",
		"BETTER_COMPUTE_HEALTH_LISTEN="+health, "BETTER_COMPUTE_LEASE_HOLDER=bench-scheduler")
}

// startService starts bin/linux/<name> with env and the fleet's database
// (its connections named after the service: application_name, which
// pg_stat_activity shows), waits until probes' /readyz answers, and records
// it with its metrics URL (and a profiling server on a free loopback port
// when profiles are asked for).
func (f *fleet) startService(b *testing.B, name, probes, metrics string, env ...string) {
	b.Helper()
	u, err := url.Parse(f.dbURL)
	require.NoError(b, err)
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	env = append(env, "BETTER_COMPUTE_DATABASE_URL="+u.String())
	s := &serviceProc{name: name, metrics: metrics}
	if profileDir() != "" {
		s.pprof = procs.FreeAddr(b)
		env = append(env, "BETTER_COMPUTE_PPROF_LISTEN="+s.pprof)
	}
	s.proc = procs.Start(b, name, probes, env...)
	f.services[name] = s
}

// readExports reads the `export KEY=value` lines of a bootstrap env file.
func readExports(tb testing.TB, path string) map[string]string {
	tb.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(tb, err)
	out := map[string]string{}
	for _, line := range strings.Split(string(raw), "\n") {
		k, v, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(line), "export "), "=")
		if ok {
			out[k] = strings.Trim(v, `"'`)
		}
	}
	return out
}

// cpuGroups is the CPU time used so far by each process group: each
// service process by name, "postgres" and "nats" (their containers'
// cgroups), "machines" (the fakedaemon process) and "callers" (this
// process: the benchmark's callers and queries).
type cpuGroups map[string]time.Duration

// Group names of cpuGroups besides the services'.
const (
	groupPostgres = "postgres"
	groupNATS     = "nats"
	groupMachines = "machines"
	groupCallers  = "callers"
)

// controlPlaneGroups are the groups of the control plane, in print order.
var controlPlaneGroups = append(slices.Clone(serviceNames), groupPostgres, groupNATS)

// cpu samples every group's CPU time.
func (f *fleet) cpu(tb testing.TB) cpuGroups {
	tb.Helper()
	if f.pgID == "" {
		f.pgID, f.natsID = containerOf(tb, f.dbURL), containerOf(tb, f.natsURL)
	}
	g := cpuGroups{groupPostgres: containerCPU(tb, f.pgID), groupNATS: containerCPU(tb, f.natsID),
		groupCallers: procCPU(tb, os.Getpid())}
	for name, s := range f.services {
		g[name] = procCPU(tb, s.proc.PID())
	}
	if f.machinesPID != 0 {
		g[groupMachines] = procCPU(tb, f.machinesPID)
	}
	return g
}

// sub is g − o, group by group.
func (g cpuGroups) sub(o cpuGroups) cpuGroups {
	out := cpuGroups{}
	for k, v := range g {
		out[k] = v - o[k]
	}
	return out
}

// controlPlane is the CPU time of the services, Postgres and NATS.
func (g cpuGroups) controlPlane() time.Duration {
	var t time.Duration
	for _, k := range controlPlaneGroups {
		t += g[k]
	}
	return t
}

// perOp says g divided by ops, group by group: "api 120µs, gateway 80µs, …,
// control plane 400µs; machines 90µs, callers 30µs".
func (g cpuGroups) perOp(ops int) string {
	d := func(t time.Duration) string { return (t / time.Duration(max(1, ops))).Round(time.Microsecond).String() }
	return g.say(d) + "; callers " + d(g[groupCallers])
}

// share says g as percentages of one core over d, group by group.
func (g cpuGroups) share(d time.Duration) string {
	return g.say(func(t time.Duration) string { return fmt.Sprintf("%.2f", 100*t.Seconds()/d.Seconds()) }) + " (% of one core)"
}

// say says each control-plane group of g, their total and the machines'
// with f: "api F, gateway F, …; control plane F; machines F".
func (g cpuGroups) say(f func(time.Duration) string) string {
	parts := []string{}
	for _, k := range controlPlaneGroups {
		if v, ok := g[k]; ok {
			parts = append(parts, k+" "+f(v))
		}
	}
	s := strings.Join(parts, ", ") + "; control plane " + f(g.controlPlane())
	if v, ok := g[groupMachines]; ok {
		s += "; machines " + f(v)
	}
	return s
}

// metrics scrapes every service's GET /metrics and returns the sum of each
// series name's samples (labels dropped) by service: scrape[svc][name].
func (f *fleet) metrics(tb testing.TB) map[string]map[string]float64 {
	tb.Helper()
	out := map[string]map[string]float64{}
	for name, s := range f.services {
		resp, err := http.Get(s.metrics)
		require.NoError(tb, err)
		out[name] = parseMetrics(resp.Body)
		resp.Body.Close()
	}
	return out
}

// parseMetrics sums the samples of each series name of a Prometheus text
// exposition.
func parseMetrics(r io.Reader) map[string]float64 {
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		name := line[:i]
		if j := strings.IndexByte(name, '{'); j >= 0 {
			name = name[:j]
		}
		out[strings.TrimSpace(name)] += v
	}
	return out
}

// poolLine says the database pool acquires each service made between two
// scrapes, per operation: "api 3.0 (waited 0.1), gateway 2.0 (…)".
func poolLine(before, after map[string]map[string]float64, ops int) string {
	parts := []string{}
	for _, name := range serviceNames {
		a, ok := after[name]
		if !ok {
			continue
		}
		acq := a["pgxpool_acquires_total"] - before[name]["pgxpool_acquires_total"]
		empty := a["pgxpool_empty_acquire_total"] - before[name]["pgxpool_empty_acquire_total"]
		if acq == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %.2f (waited %.2f)", name, acq/float64(ops), empty/float64(ops)))
	}
	return "pool acquires per operation: " + strings.Join(parts, ", ")
}

// profile takes a CPU profile of every service process over the next
// seconds (at least 1), each into DIR/<benchmark>.<service>.pprof (with a
// phase, DIR/<benchmark>-<phase>.<service>.pprof, and likewise the
// allocation profiles below; "" names a benchmark's saturated phase), when
// BETTER_COMPUTE_BENCH_PROFILE_DIR=DIR is set, and its allocations
// (/debug/pprof/allocs?gc=1, which counts from the process's start; gc=1
// runs a collection first, so that it holds every allocation so far) now,
// into
// DIR/<benchmark>.<service>.allocs.base.pprof, and when the returned
// function is called, into DIR/<benchmark>.<service>.allocs.pprof: the
// phase's allocations are their difference (pprof -diff_base). The
// returned function waits until every profile is written; the benchmark
// calls it at the end of the phase (a phase that ends sooner leaves an idle
// tail in the CPU profile, which adds almost no samples; one that lasts
// longer is profiled over its first seconds only).
// BETTER_COMPUTE_BENCH_PROFILE_SECONDS, when set, replaces seconds.
//
// The machines' process (machines in the file names) is profiled likewise
// when it runs from startMachinesProcess; when profile is called before it
// starts (join → adoption), its CPU profile is asked for as soon as its
// profiling server answers, and its allocations are counted from its start.
//
// The services named in paused are stopped (SIGSTOP) and about to be
// continued: their allocations at the start were taken before they were
// stopped (allocsBase), and their CPU profiles, asked for now, start when
// they run again (their profiling server answers once the process runs).
// profile returns once the other services' allocation profiles are written.
func (f *fleet) profile(b *testing.B, phase string, seconds int, paused ...string) (wait func()) {
	b.Helper()
	dir := profileDir()
	if dir == "" {
		return func() {}
	}
	require.NoError(b, os.MkdirAll(dir, 0o755))
	seconds = envInt("BETTER_COMPUTE_BENCH_PROFILE_SECONDS", max(1, seconds))
	prefix := filepath.Join(dir, strings.SplitN(b.Name(), "/", 2)[0])
	if phase != "" {
		prefix += "-" + phase
	}
	allocs := func(s *serviceProc, suffix string) error {
		return fetchProfile("http://"+s.pprof+"/debug/pprof/allocs?gc=1", prefix+"."+s.name+suffix, 30*time.Second)
	}
	var (
		wg, based sync.WaitGroup
		mu        sync.Mutex
		errs      []error
	)
	fail := func(err error) {
		if err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
	}
	targets := maps.Clone(f.services)
	if f.runner == nil {
		if f.machinesPprof == "" {
			f.machinesPprof = procs.FreeAddr(b)
		}
		targets[machinesProfile] = &serviceProc{name: machinesProfile, pprof: f.machinesPprof}
	}
	machinesLater := f.runner == nil && f.machinesPID == 0
	for name, s := range targets {
		wg.Add(1)
		isPaused := slices.Contains(paused, name) || (name == machinesProfile && machinesLater)
		if !isPaused {
			based.Add(1)
		}
		go func() {
			defer wg.Done()
			var err error
			if !isPaused {
				err = allocs(s, ".allocs.base.pprof")
				based.Done()
			}
			if err != nil {
				fail(err)
				return
			}
			url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", s.pprof, seconds)
			timeout := time.Duration(seconds+30) * time.Second
			if name == machinesProfile && machinesLater {
				// Asked for until the process is up; a benchmark that never
				// starts it has no profile of it.
				if err := fetchProfileWhenUp(url, prefix+"."+name+".pprof", timeout); err != nil {
					fmt.Printf("  no CPU profile of the machines' process: %v\n", err)
				}
				return
			}
			fail(fetchProfile(url, prefix+"."+name+".pprof", timeout))
		}()
	}
	based.Wait()
	return func() {
		var ends sync.WaitGroup
		for name, s := range targets {
			if name == machinesProfile && f.machinesPID == 0 {
				continue
			}
			ends.Add(1)
			go func() {
				defer ends.Done()
				fail(allocs(s, ".allocs.pprof"))
			}()
		}
		ends.Wait()
		wg.Wait()
		for _, err := range errs {
			require.NoError(b, err)
		}
		fmt.Printf("  profiles: CPU over %d s and allocations in %s.<service>{,.allocs,.allocs.base}.pprof\n",
			seconds, prefix)
	}
}

// allocsBase writes service name's allocations so far into the allocation
// profile at the start of a phase (see profile) now, before it is stopped;
// it does nothing unless BETTER_COMPUTE_BENCH_PROFILE_DIR is set.
func (f *fleet) allocsBase(b *testing.B, name string) {
	b.Helper()
	dir := profileDir()
	if dir == "" {
		return
	}
	require.NoError(b, os.MkdirAll(dir, 0o755))
	prefix := filepath.Join(dir, strings.SplitN(b.Name(), "/", 2)[0])
	require.NoError(b, fetchProfile("http://"+f.services[name].pprof+"/debug/pprof/allocs?gc=1",
		prefix+"."+name+".allocs.base.pprof", 30*time.Second))
}

// machinesProfile names the machines' process in profile's file names.
const machinesProfile = "machines"

// fetchProfileWhenUp is fetchProfile of a server that may not be listening
// yet: a refused connection is tried again every 20 ms, within timeout.
func fetchProfileWhenUp(url, path string, timeout time.Duration) error {
	clk := clock.New()
	deadline := clk.Now().Add(timeout)
	t := clk.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		err := fetchProfile(url, path, deadline.Sub(clk.Now()))
		if err == nil || !errors.Is(err, syscall.ECONNREFUSED) || !clk.Now().Before(deadline) {
			return err
		}
		<-t.C()
	}
}

// fetchProfile GETs url into file path, within timeout.
func fetchProfile(url, path string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, resp.Body); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
