package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pgembed"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Defaults and bounds of `better-compute dev`.
const (
	devDefaultHost = "127.0.0.1"
	devDefaultPort = 3000
	// devStateDir is the directory, in the working directory, of dev's
	// files: the default --data, dev.env and dev-pins.json.
	devStateDir    = ".better-compute"
	devDefaultData = devStateDir + "/dev-db"
	// devMaxSim is the most simulated machines --sim accepts.
	devMaxSim = 10000
	// devConfigFile is the configuration dev discovers in the working
	// directory when neither --config nor BETTER_COMPUTE_CONFIG names one.
	devConfigFile = "better-compute.env"
)

// devConfigKeys are the settings a dev configuration file may hold, the
// variables of DevSettings, with what each means for dev.
var devConfigKeys = map[string]string{
	"BETTER_COMPUTE_DATABASE_URL":  "the deployment's database (postgres://…); no embedded PostgreSQL is started",
	"BETTER_COMPUTE_NATS_URL":      "the deployment's NATS server (nats://…); no embedded NATS is started",
	"BETTER_COMPUTE_PKI_DIR":       "the deployment's PKI directory (`better-compute pki init`), instead of <data>/pki",
	"BETTER_COMPUTE_SIGNED_INTENT": "true (dev's default) or false: sign every command and NodeSpec with the command-signing root",
}

// DevSettings are the deployment settings of `better-compute dev`, from its
// configuration file with the environment over it (devConfigKeys): the
// services' own settings, with dev's defaults. Unset, dev starts an
// embedded PostgreSQL and NATS, keeps the PKI in <data>/pki and signs
// intent.
type DevSettings struct {
	service.Database
	service.NATS   `default:"NATS_URL="`
	service.PKI    `default:"PKI_DIR="`
	service.Intent `default:"SIGNED_INTENT=true"`
}

// DevLog is dev's telemetry settings, from the environment only:
// BETTER_COMPUTE_LOG_LEVEL, warn by default (the progress lines are what a
// developer reads), and BETTER_COMPUTE_METRICS_EXPORTER, the one pipeline of
// every service in the process (served on the API's GET /metrics).
type DevLog struct {
	telemetry.Settings `default:"LOG_LEVEL=warn"`
	telemetry.MetricsSettings
}

// devFlags are the flags of `better-compute dev`.
type devFlags struct {
	host       string
	port       int
	data       string
	memory     bool
	config     string
	sim        int
	simVariant string
}

func (a *app) devCmd() *cobra.Command {
	var f devFlags
	c := &cobra.Command{
		Use:   "dev [--memory] [--sim N] [--sim-variant VARIANT]",
		Short: "Run the whole control plane in one process on this machine, with simulated GPU machines",
		Long: "dev migrates the database, then serves the API under /api/compute and runs joinservice, a gateway,\n" +
			"the scheduler and the controllers in this process, the same packages the service binaries run.\n\n" +
			"Without a configuration (and without BETTER_COMPUTE_DATABASE_URL) it builds its own deployment in --data:\n" +
			"an embedded PostgreSQL server started from this machine's PostgreSQL binaries (as an unprivileged user\n" +
			"when run as root), an embedded NATS server, a generated PKI and secret (owner-only), all kept between\n" +
			"runs; --memory uses a throwaway database instead. A configuration file (--config, BETTER_COMPUTE_CONFIG,\n" +
			"or ./" + devConfigFile + ") holds KEY=VALUE lines of the services' settings:\n" + devConfigHelp() +
			"Every run prints the root tenant and a root administrator's token (a development credential) and writes\n" +
			"BETTER_COMPUTE_URL, _TOKEN, _TENANT (and with --sim _POOL) to " + devStateDir + "/dev.env (mode 0600)\n" +
			"and the deployment's pins to " + devStateDir + "/dev-pins.json, so `source " + devStateDir + "/dev.env` makes every other command work.\n\n" +
			"--sim N creates site dev-1 (region dev-1), a metal-host pool sim-VARIANT whose acceptance fits the\n" +
			"variant and a join token of N uses, and joins N simulated machines the way real ones join (sealed token,\n" +
			"pinned keys, mTLS sessions to the gateway). Variants: hgx-h100 (8x H100; pool: H100, 8 GPUs),\n" +
			"hgx-h100-gpu-missing (one GPU missing: fails acceptance), l40s (4x L40S; pool: L40S, 4 GPUs), cpu (no\n" +
			"GPUs; no model or count check). Machines from outside join too: `fakedaemon --server <URL> --pins-file\n" +
			devStateDir + "/dev-pins.json`.\n\n" +
			"One dev at a time uses a --data directory; in one working directory the first dev running owns dev.env\n" +
			"(a second prints its environment instead). SIGINT, SIGTERM or SIGHUP (a closed terminal) stops the\n" +
			"machines, the services (releasing their leases) and the embedded servers; after a crash (kill -9) the\n" +
			"next run cleans up by itself.",
		Args: cobra.NoArgs,
	}
	fl := c.Flags()
	fl.StringVar(&f.host, "host", devDefaultHost, "the address to listen on")
	fl.IntVar(&f.port, "port", devDefaultPort, "the API's port; 0 picks a free one (env PORT)")
	fl.StringVar(&f.data, "data", devDefaultData, "where the database (unless configured), the PKI, the root token and the simulated machines are kept")
	fl.BoolVar(&f.memory, "memory", false, "a throwaway database, PKI and machines, removed at exit (a configured database is not used)")
	fl.StringVar(&f.config, "config", "", "the configuration file (env BETTER_COMPUTE_CONFIG; default ./"+devConfigFile+" when it exists)")
	fl.IntVar(&f.sim, "sim", 0, fmt.Sprintf("join N simulated machines, 0 to %d", devMaxSim))
	fl.StringVar(&f.simVariant, "sim-variant", fakehw.VariantHGXH100, "hardware of the simulated machines: "+strings.Join(fakehw.Variants(), ", "))
	_ = c.RegisterFlagCompletionFunc("sim-variant", func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return fakehw.Variants(), cobra.ShellCompDirectiveNoFileComp
	})
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if !cmd.Flags().Changed("port") {
			if v := a.env.Getenv("PORT"); v != "" {
				p, err := strconv.Atoi(v)
				if err != nil {
					return fmt.Errorf("PORT: %q is not a port number", v)
				}
				f.port = p
			}
		}
		if f.memory && cmd.Flags().Changed("data") {
			return errors.New("--memory and --data cannot be used together: --memory keeps no data")
		}
		// A reader of dev's output that went away (`dev | tee` interrupted)
		// must not kill dev before it cleaned up: writes fail instead.
		signal.Ignore(syscall.SIGPIPE)
		return a.runDev(cmd.Context(), f)
	}
	return c
}

// devConfigNames are the keys of devConfigKeys, sorted.
func devConfigNames() []string {
	keys := make([]string, 0, len(devConfigKeys))
	for k := range devConfigKeys {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// devConfigHelp lists the configuration's settings for --help.
func devConfigHelp() string {
	var b strings.Builder
	for _, k := range devConfigNames() {
		fmt.Fprintf(&b, "  %-29s %s\n", k, devConfigKeys[k])
	}
	return b.String() + "The environment overrides the file.\n\n"
}

// validate checks the flags that need no I/O.
func (f devFlags) validate() error {
	if f.port < 0 || f.port > 65535 {
		return fmt.Errorf("--port: %d is not a port (0 to 65535)", f.port)
	}
	if f.sim < 0 || f.sim > devMaxSim {
		return fmt.Errorf("--sim: %d is out of range (0 to %d)", f.sim, devMaxSim)
	}
	if !slices.Contains(fakehw.Variants(), f.simVariant) {
		return fmt.Errorf("--sim-variant: unknown variant %q (want %s)", f.simVariant, strings.Join(fakehw.Variants(), ", "))
	}
	if strings.TrimSpace(f.host) == "" {
		return errors.New("--host: must not be empty")
	}
	if !f.memory && strings.TrimSpace(f.data) == "" {
		return errors.New("--data: must not be empty")
	}
	return nil
}

// devConfig is dev's deployment settings (DevSettings) and where each came
// from, for messages: the variable itself or "FILE:LINE: VARIABLE".
type devConfig struct {
	DevSettings
	from map[string]string
}

// loadDevConfig reads the configuration file (--config, else
// BETTER_COMPUTE_CONFIG, else ./better-compute.env when it exists) and the
// environment into DevSettings (pkg/config), and checks what it can without
// starting anything.
func (a *app) loadDevConfig(flag string) (devConfig, error) {
	cfg := devConfig{from: map[string]string{}}
	path, name := flag, "--config"
	if path == "" {
		path, name = a.env.Getenv("BETTER_COMPUTE_CONFIG"), "BETTER_COMPUTE_CONFIG"
	}
	if path == "" {
		if _, err := os.Stat(devConfigFile); err == nil {
			path, name = devConfigFile, devConfigFile
		}
	}
	vals := map[string]string{}
	if path != "" {
		var err error
		if vals, cfg.from, err = parseDevConfig(path); err != nil {
			return cfg, fmt.Errorf("%s: %w", name, err)
		}
	}
	for k := range devConfigKeys {
		if v := a.env.Getenv(k); v != "" {
			vals[k], cfg.from[k] = v, k
		}
	}
	if err := config.Load(&cfg.DevSettings, func(k string) string { return vals[k] }); err != nil {
		var bad *config.Error
		if errors.As(err, &bad) {
			return cfg, fmt.Errorf("%s: %w", cfg.from[bad.Name], bad.Err)
		}
		return cfg, err
	}
	if cfg.PKIDir != "" {
		if fi, err := os.Stat(cfg.PKIDir); err != nil || !fi.IsDir() {
			return cfg, fmt.Errorf("%s: %s is not a directory (`better-compute pki init --dir %s` makes a deployment's PKI)",
				cfg.from[config.Prefix+"PKI_DIR"], cfg.PKIDir, cfg.PKIDir)
		}
	}
	return cfg, nil
}

// parseDevConfig reads KEY=VALUE lines (an optional "export ", blank lines
// and # comments, values optionally quoted) of the keys in devConfigKeys,
// and where each was ("PATH:LINE: KEY").
func parseDevConfig(path string) (map[string]string, map[string]string, error) {
	file, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("%s does not exist", path)
	}
	if err != nil {
		return nil, nil, err
	}
	defer file.Close()
	vals, from := map[string]string{}, map[string]string{}
	sc := bufio.NewScanner(file)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(strings.TrimPrefix(line, "export "), "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" {
			return nil, nil, fmt.Errorf("%s:%d: want KEY=VALUE, got %q", path, n, line)
		}
		if _, known := devConfigKeys[k]; !known {
			return nil, nil, fmt.Errorf("%s:%d: unknown setting %s (known: %s)", path, n, k, strings.Join(devConfigNames(), ", "))
		}
		v = strings.TrimSpace(v)
		if len(v) >= 2 && (v[0] == '"' || v[0] == '\'') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		vals[k], from[k] = v, fmt.Sprintf("%s:%d: %s", path, n, k)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return vals, from, nil
}

// devState is the working directory's .better-compute: dev.env and
// dev-pins.json belong to the dev that holds its lock (dev.lock). A dev takes
// the lock once its control plane runs; another dev running in the same
// directory prints its own environment instead, and takes the files over
// when the owner stops.
type devState struct {
	created bool // this run made the directory

	mu   sync.Mutex
	lock *os.File // held: this dev owns the files
	env  string   // this dev's CLI environment (dev.env's content)
	pins []byte   // this dev's dev-pins.json
}

// openDevState makes .better-compute (0700) when missing and checks that it
// is a directory this process can write.
func openDevState() (*devState, error) {
	d := &devState{}
	err := os.Mkdir(devStateDir, 0o700)
	switch {
	case err == nil:
		d.created = true
	case !errors.Is(err, fs.ErrExist):
		return nil, fmt.Errorf("%s: cannot create it: %w", devStateDir, errors.Unwrap(err))
	}
	if fi, err := os.Stat(devStateDir); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory (dev keeps dev.env and dev-pins.json there)", devStateDir)
	}
	probe, err := os.CreateTemp(devStateDir, ".write-test-")
	if err != nil {
		d.close(true)
		return nil, fmt.Errorf("%s is not writable: %w", devStateDir, errors.Unwrap(err))
	}
	probe.Close()
	_ = os.Remove(probe.Name())
	return d, nil
}

// tryOwn takes dev.lock when it is free and reports whether this dev holds
// it, or else the pid of the dev that does.
func (d *devState) tryOwn() (bool, string) {
	if d.lock != nil {
		return true, ""
	}
	if err := os.MkdirAll(devStateDir, 0o700); err != nil {
		return false, "unknown"
	}
	lock, err := os.OpenFile(filepath.Join(devStateDir, "dev.lock"), os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return false, "unknown"
	}
	if syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		b, _ := os.ReadFile(lock.Name())
		lock.Close()
		return false, strings.TrimSpace(string(b))
	}
	d.lock = lock
	_ = lock.Truncate(0)
	_, _ = lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return true, ""
}

// write writes dev.env and dev-pins.json; the caller holds d.mu and the
// lock.
func (d *devState) write() error {
	if err := writeFileAtomic(filepath.Join(devStateDir, "dev.env"), []byte(d.env), 0o600); err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(devStateDir, "dev-pins.json"), d.pins, 0o644)
}

// close unlocks; with failed, it removes the directory when this run made
// it and it is empty.
func (d *devState) close(failed bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lock != nil {
		d.lock.Close()
		d.lock = nil
	}
	if failed && d.created {
		_ = os.Remove(devStateDir) // only when empty: another dev may use it
	}
}

// runDev is `better-compute dev`.
func (a *app) runDev(ctx context.Context, f devFlags) (err error) {
	if err := f.validate(); err != nil {
		return err
	}
	cfg, err := a.loadDevConfig(f.config)
	if err != nil {
		return err
	}
	logger, err := devLogger(a.env)
	if err != nil {
		return err
	}
	metrics, err := telemetry.SetupMetrics(ctx, "better-compute-dev", a.env.Getenv)
	if err != nil {
		return err
	}
	defer func() { _ = metrics.Shutdown(context.WithoutCancel(ctx)) }()
	if f.memory {
		cfg.DatabaseURL = "" // --memory: a throwaway embedded database, whatever the configuration says
	}
	var binDir string
	if cfg.DatabaseURL == "" {
		if binDir, err = pgembed.FindBinDir(a.env.Getenv); err != nil {
			return err
		}
	}
	state, err := openDevState()
	if err != nil {
		return err
	}
	addr := net.JoinHostPort(f.host, strconv.Itoa(f.port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		state.close(true)
		if errors.Is(err, syscall.EADDRINUSE) {
			return fmt.Errorf("--port: %s is already in use (--port 0 picks a free port)", addr)
		}
		return fmt.Errorf("--host: cannot listen on %s: %w", addr, err)
	}
	dataDir := ""
	if !f.memory {
		dataDir = f.data
	}
	// The signal ends the run below, and Close then stops the machines
	// before the services they talk to; ctx bounds the start only.
	st, err := devstack.Start(ctx, devstack.Options{
		DataDir:        dataDir,
		DatabaseURL:    cfg.DatabaseURL,
		PostgresBinDir: binDir,
		NATSURL:        cfg.NATSURL,
		PKIDir:         cfg.PKIDir,
		APIListener:    ln,
		Host:           f.host,
		Logger:         logger,
		MachineLogger:  logger.With("service", "fakedaemon"),
		SignedIntent:   cfg.SignedIntent,
		Metrics:        metrics,
		// A laptop's reconcilers look often: adoption in well under a second.
		ReconcileInterval: 250 * time.Millisecond,
	})
	// The startup text (URLs, the credentials, the environment to paste)
	// is standard output; warnings, errors and the services' logs are
	// standard error.
	w, warn := a.env.Stdout, a.env.Stderr
	if err != nil {
		state.close(true)
		if ctx.Err() != nil {
			fmt.Fprintln(w, "interrupted while starting")
			return nil
		}
		return devStartError(err, cfg)
	}
	defer func() {
		if cerr := st.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("stopping: %w", cerr)
		}
		state.close(false)
	}()
	gateway := "Gateway (mTLS)"
	if ip := net.ParseIP(f.host); f.host == "localhost" || (ip != nil && ip.IsLoopback()) {
		gateway = "Gateway (mTLS, loopback)"
	}
	fmt.Fprintf(w, "better-compute listening on %s/api/compute\n", st.APIURL)
	if st.MetricsURL != "" {
		fmt.Fprintf(w, "Metrics of every service: %s\n", st.MetricsURL)
	}
	fmt.Fprintf(w, "%s: %s\n", gateway, st.GatewayURL())
	for _, warning := range st.Warnings {
		fmt.Fprintf(warn, "warning: %s\n", warning)
	}
	fmt.Fprintf(w, "Root tenant %s; root token (dev only): %s\n", st.TenantID, st.RootToken)
	envCtx, stopTakeover := context.WithCancel(ctx)
	defer stopTakeover()
	if err := a.devEnv(envCtx, state, st, ""); err != nil {
		return err
	}
	if f.sim == 0 && dataDir != "" {
		if n := savedMachines(filepath.Join(st.DataDir(), devstack.DirMachines)); n > 0 {
			fmt.Fprintf(warn, "warning: %s holds %d simulated machine(s) of an earlier run, not started: pass --sim %d to start them\n",
				dataDir, n, n)
		}
	}
	if f.sim > 0 {
		if err := a.devSim(envCtx, state, st, f, cfg); err != nil {
			if ctx.Err() != nil {
				fmt.Fprintln(w, "stopping")
				return nil // stopped while the machines joined
			}
			return err
		}
	}
	select {
	case <-ctx.Done():
	case <-st.Done():
	}
	if ctx.Err() != nil {
		fmt.Fprintln(w, "stopping")
		return nil
	}
	return fmt.Errorf("the control plane stopped: %w", st.Err())
}

// devSim joins --sim machines and reports their acceptance: adopted (or,
// for hgx-h100-gpu-missing, failed acceptance) and connected in this run.
func (a *app) devSim(ctx context.Context, state *devState, st *devstack.Stack, f devFlags, cfg devConfig) error {
	w, warn := a.env.Stdout, a.env.Stderr
	po, err := devstack.VariantPool(f.simVariant)
	if err != nil {
		return err
	}
	pool, err := st.CreatePool(ctx, po)
	if err != nil {
		return err
	}
	if err := a.devEnv(ctx, state, st, pool); err != nil {
		return err
	}
	nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: f.sim, Variant: f.simVariant})
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "Joined %d simulated %s node(s) into %s\n", len(nodes), f.simVariant, pool)
	if !cfg.SignedIntent {
		if n := requireSignedIntent(st); n > 0 {
			fmt.Fprintf(warn, "warning: signed intent is off (BETTER_COMPUTE_SIGNED_INTENT=false), but %d simulated machine(s) joined "+
				"when it was on and refuse unsigned commands and NodeSpecs: turn it on again, or use another --data\n", n)
		}
	}
	want := store.NodeAdopted
	if f.simVariant == fakehw.VariantHGXH100GPUMissing {
		want = store.NodeAcceptanceFailed
	}
	// Acceptance runs diag.nvml on every machine: allow for a large fleet
	// on a small laptop.
	timeout := max(time.Minute, time.Duration(f.sim)*100*time.Millisecond)
	statuses, err := st.WaitFor(ctx, nodes, devstack.WaitOptions{State: want, Timeout: timeout, Connected: true})
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		// The control plane keeps running: say what is wrong and go on.
		fmt.Fprintf(warn, "warning: %v\n", err)
		return nil
	}
	if want == store.NodeAdopted {
		fmt.Fprintf(w, "%d simulated node(s) adopted\n", len(nodes))
		return nil
	}
	reasons := map[string]int{}
	for _, s := range statuses {
		reasons[s.ProvisionReason]++
	}
	keys := make([]string, 0, len(reasons))
	for r := range reasons {
		keys = append(keys, r)
	}
	slices.Sort(keys)
	for _, r := range keys {
		fmt.Fprintf(w, "%d simulated node(s) failed acceptance: %s\n", reasons[r], r)
	}
	return nil
}

// savedMachines counts the simulated machines kept in dir (the data
// directory's machines: one directory per Join, one per machine in it) that
// joined in an earlier run; 0 when there are none or dir cannot be read.
func savedMachines(dir string) int {
	joins, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	n := 0
	for _, j := range joins {
		if !j.IsDir() {
			continue
		}
		machines, err := os.ReadDir(filepath.Join(dir, j.Name()))
		if err != nil {
			continue
		}
		for _, m := range machines {
			if _, err := strconv.Atoi(m.Name()); err != nil || !m.IsDir() {
				continue
			}
			if ok, err := agent.Joined(filepath.Join(dir, j.Name(), m.Name())); err == nil && ok {
				n++
			}
		}
	}
	return n
}

// requireSignedIntent counts the stack's machines whose identity holds a
// command-signing root: they refuse unsigned intent.
func requireSignedIntent(st *devstack.Stack) int {
	n := 0
	for _, m := range st.Daemons() {
		if id, err := agent.ReadIdentity(m.Dir()); err == nil && id != nil && len(id.CommandSigningRoot) > 0 {
			n++
		}
	}
	return n
}

// devEnv sets this dev's CLI environment (with BETTER_COMPUTE_POOL when
// pool is set) and pins, and writes them to .better-compute/dev.env (0600)
// and dev-pins.json when this dev owns them. The first call takes the files
// when they are free, else prints the environment and keeps trying (until
// ctx ends) to take them over from the dev that owns them.
func (a *app) devEnv(ctx context.Context, state *devState, st *devstack.Stack, pool string) error {
	env := fmt.Sprintf("export BETTER_COMPUTE_URL=%s\nexport BETTER_COMPUTE_TOKEN=%s\nexport BETTER_COMPUTE_TENANT=%s\n",
		st.APIURL, st.RootToken, st.TenantID)
	if pool != "" {
		env += "export BETTER_COMPUTE_POOL=" + pool + "\n"
	}
	pins, err := json.MarshalIndent(st.Pins, "", "  ")
	if err != nil {
		return err
	}
	w := a.env.Stdout
	state.mu.Lock()
	defer state.mu.Unlock()
	first := state.env == ""
	state.env, state.pins = env, append(pins, '\n')
	owned, holder := state.tryOwn()
	switch {
	case owned:
		if err := state.write(); err != nil {
			return err
		}
		if first {
			fmt.Fprintf(w, "CLI environment: source %s\n", filepath.Join(devStateDir, "dev.env"))
		}
	case first:
		fmt.Fprintf(w, "Another better-compute dev (pid %s) owns %s in this directory; this one's CLI environment:\n%s",
			holder, filepath.Join(devStateDir, "dev.env"), env)
		go a.takeOverDevEnv(ctx, state)
	default:
		fmt.Fprintf(w, "export BETTER_COMPUTE_POOL=%s\n", pool)
	}
	return nil
}

// takeOverDevEnv takes dev.env and dev-pins.json over once the dev that
// owns them stops, checking every second until ctx ends.
func (a *app) takeOverDevEnv(ctx context.Context, state *devState) {
	tick := a.env.Clock.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
		state.mu.Lock()
		if ctx.Err() == nil {
			if owned, _ := state.tryOwn(); owned {
				if err := state.write(); err == nil {
					fmt.Fprintf(a.env.Stdout, "CLI environment: source %s (the dev that had it stopped)\n", filepath.Join(devStateDir, "dev.env"))
				}
				state.mu.Unlock()
				return
			}
		}
		state.mu.Unlock()
	}
}

// writeFileAtomic replaces path with content (mode) through a rename.
func writeFileAtomic(path string, content []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(content); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// devStartError names the flag or setting behind a failed start where one
// is.
func devStartError(err error, cfg devConfig) error {
	var dd *devstack.DataDirError
	switch {
	case errors.As(err, &dd):
		return fmt.Errorf("--data: %s %s", dd.Dir, dd.Msg)
	case cfg.NATSURL != "" && strings.Contains(err.Error(), cfg.NATSURL):
		return fmt.Errorf("%s: cannot reach the NATS server: %w", cfg.from["BETTER_COMPUTE_NATS_URL"], err)
	}
	return err
}

// devLogger is dev's log: JSON on standard error at DevLog's level.
func devLogger(env Env) (*slog.Logger, error) {
	var l DevLog
	if err := config.Load(&l, env.Getenv); err != nil {
		return nil, err
	}
	return telemetry.NewLoggerAt(env.Stderr, "", slog.Level(l.LogLevel)), nil // devstack names each service
}
