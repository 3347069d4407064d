// Package devstack runs the whole better-compute control plane in one process
// on loopback: api, joinservice, N gateways, scheduler and controllers, the
// same packages the service binaries run, plus simulated GPU machines (the
// fakedaemon's: pkg/agent on pkg/fakehw) that join it as real machines do.
// `better-compute dev`, the integration suites of tests/ and the benchmarks
// run on it, and so can a test in any module of the workspace:
//
//	st, err := devstack.Start(ctx, devstack.Options{}) // embedded Postgres and NATS
//	defer st.Close()
//	pool, err := st.CreatePool(ctx, devstack.PoolOptions{GPUModel: "H100", ExpectGPUs: 8})
//	nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: 3})
//	_, err = st.WaitFor(ctx, nodes, devstack.WaitOptions{}) // adopted, NodeSpec ≥ 1 applied
//
// With zero Options the stack is throwaway: an embedded PostgreSQL server
// (pgembed, from the machine's PostgreSQL binaries) in memory, an embedded
// NATS server, and a PKI in a temporary directory, all removed by Close. With
// Options.DataDir the database, the PKI, the root token, the ports and the
// simulated machines' identities are kept there between runs. DatabaseURL and
// NATSURL use servers of the caller's instead.
//
// Start migrates the database, ensures the PKI and the root tenant with a
// root administrator's token, and starts every service; Close stops the
// machines, then the services (releasing their leases), then the embedded
// servers.
package devstack

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/pkg/bootstrap"
	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pgembed"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/controllers/controllers"
	"github.com/better-compute/better-compute/services/gateway/gateway"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// Names of what a stack keeps in Options.DataDir.
const (
	// DirPostgres is the embedded PostgreSQL cluster.
	DirPostgres = "postgres"
	// DirPKI is the deployment's PKI (`better-compute pki init`'s files).
	DirPKI = "pki"
	// DirServicePKI holds each service's own PKI directory,
	// DirServicePKI/<service>: the files of DirPKI it reads (pki.Export),
	// made again at every Start, so that each service runs with only its
	// keys as it does in compose.
	DirServicePKI = "service-pki"
	// DirMachines holds the simulated machines, one directory per Join.
	DirMachines = "machines"
	// FileSecret is the embedded PostgreSQL superuser's password (0600).
	FileSecret = "secret"
	// FileRootEnv holds the root tenant and root token (0600).
	FileRootEnv = "root.env"
	// FileState records the stack's instance name and the gateway and
	// JoinService ports, reused by the next run so machines that joined
	// find the gateways again.
	FileState = "state.json"
)

// devJoinLimit is the join burst and rate per second (joinservice.Config
// JoinBurst, JoinRate) of a dev stack, whose machines all join from one
// address: far above any fleet it simulates.
const devJoinLimit = 1 << 20

// DefaultWaitTimeout is how long WaitFor waits when WaitOptions.Timeout is 0.
const DefaultWaitTimeout = 30 * time.Second

// Options configure Start. The zero value is a throwaway stack on embedded
// servers.
type Options struct {
	// DataDir keeps the stack's state between runs (see the Dir* and File*
	// names): created 0700 when missing. Empty: a temporary directory that
	// Close removes, and the embedded database runs in memory.
	DataDir string
	// DatabaseURL is a postgres:// URL of a database of the caller's; Start
	// migrates it up. Empty: an embedded PostgreSQL server (pgembed) in
	// DataDir/postgres, or in memory without DataDir.
	DatabaseURL string
	// PostgresBinDir is where the embedded server's binaries are (default:
	// pgembed.FindBinDir).
	PostgresBinDir string
	// NATSURL is a NATS server of the caller's. Empty: one in process.
	NATSURL string
	// PKIDir holds the deployment's keys; created with pki.Init when
	// missing. Empty: DataDir/pki.
	PKIDir string
	// APIListener, when set, is where the API serves (Close closes it);
	// otherwise it listens on a free port of Host.
	APIListener net.Listener
	// Gateways is how many gateway replicas to run (default 1, or 0 when
	// ExternalGatewayURL is set).
	Gateways int
	// ExternalGatewayURL, when set, is the gateway joined machines are sent
	// to (gateways run outside this process, e.g. to measure their memory or
	// kill one): one https:// URL or several separated by commas; their TLS
	// name must be "localhost".
	ExternalGatewayURL string
	// JoinServiceControlListener, when set, is where JoinService's control
	// listener (NodeCertService, mutual TLS) accepts connections (Close
	// closes it); otherwise it listens on a free port of 127.0.0.1. Gateways
	// outside this process reach it at Stack.JoinServiceControlURL.
	JoinServiceControlListener net.Listener
	// Host is the address services listen on (default 127.0.0.1), each on a
	// free port (or the port DataDir/ports.json recorded).
	Host string
	// Logger receives every service's logs (default: discarded).
	Logger *slog.Logger
	// MachineLogger receives the simulated machines' logs (default:
	// discarded).
	MachineLogger *slog.Logger
	// Clock is the services' clock (default: real).
	Clock clock.Clock
	// MaxConns caps the shared Postgres pool (default 40).
	MaxConns int32
	// ReconcileInterval, ResyncInterval and HeartbeatInterval override the
	// services' defaults when non-zero.
	ReconcileInterval, ResyncInterval, HeartbeatInterval time.Duration
	// NodeCertTTL is the lifetime of node certificates, issued at join and
	// renewed over the session (default 24 h).
	NodeCertTTL time.Duration
	// NoScheduler starts no scheduler (benchmarks run their own).
	NoScheduler bool
	// NoControllers starts no controllers (no outbox relay, acceptance or
	// expiry): the caller runs them, e.g. as their own process to measure
	// their CPU. Stack.Controllers is then nil.
	NoControllers bool
	// SignedIntent signs every command and NodeSpec with the PKI's
	// command-signing root and gives joining daemons that root, so they
	// refuse unsigned intent.
	SignedIntent bool
	// Metrics is where every service of the stack records its metrics, one
	// pipeline for them all (docs/metrics.md tells their series apart).
	// Nil: a Prometheus pipeline of the stack's own (telemetry.NewMetrics),
	// which Close shuts down. The API serves it on GET /metrics
	// (Stack.MetricsURL), with the prometheus exporter.
	Metrics *telemetry.Metrics
	// TicketBurst and TicketRate override the API's per-address limit of
	// tunnel tickets and SSH certificates (api.Config; defaults 50, then 10
	// a second) when non-zero: a benchmark opening hundreds of tunnels from
	// one address raises them.
	TicketBurst, TicketRate int
}

// Stack is a running control plane.
type Stack struct {
	// APIURL is the public API's base URL (append /api/compute for Connect);
	// it serves the well-known document daemons join from (fakedaemon
	// Config.Server).
	APIURL string
	// Pins are the deployment's pins (PKIDir/pins.json), which daemons check
	// the well-known document and their JoinResponse against.
	Pins pki.Pins
	// PKIDir is the deployment's PKI directory.
	PKIDir string
	// ServicePKIDirs are each service's own PKI directory (pki.Services
	// names them), holding only the files of PKIDir it reads: the
	// services run with these.
	ServicePKIDirs map[string]string
	// JoinURL is JoinService's base URL.
	JoinURL string
	// JoinServiceControlURL is JoinService's control listener,
	// https://127.0.0.1:PORT, where gateways have renewals signed
	// (gateway.Config JoinServiceURL; it serves the certificate
	// pki.Init issues for 127.0.0.1).
	JoinServiceControlURL string
	// Gateways are the running gateway replicas; GatewayURLs their
	// https:// Session URLs.
	Gateways    []*gateway.Server
	GatewayURLs []string
	// Controllers is the reconcilers' service (nil with NoControllers).
	Controllers *controllers.Server
	// Scheduler is the placement service.
	Scheduler *scheduler.Server
	// DB is the stack's database handle (shared by its services).
	DB *store.DB
	// DatabaseURL is the database's postgres:// URL (the embedded server's
	// when Options.DatabaseURL was empty).
	DatabaseURL string
	// NATSURL is the NATS server's URL (the embedded server's when
	// Options.NATSURL was empty).
	NATSURL string
	// TenantID is the root tenant; RootToken a root administrator's API
	// token of it (kept in DataDir/root.env and reused by the next run).
	TenantID, RootToken string
	// RootTokenMinted is false when the token of an earlier run was reused.
	RootTokenMinted bool
	// Postgres is the embedded PostgreSQL server (nil with DatabaseURL).
	Postgres *pgembed.Server
	// Instance names this stack in lease holders ("dev-<instance>-…") and
	// gateway ids ("gw-dev-<instance>-<n>"): kept in DataDir, new for a
	// throwaway stack.
	Instance string
	// Warnings are what Start found odd but could work around, one
	// sentence each (a kept port that was taken).
	Warnings []string
	// Metrics is the services' metrics pipeline (Options.Metrics or the
	// stack's own); MetricsURL is its GET /metrics, on the API's listener
	// beside the probes ("" without a Prometheus handler).
	Metrics    *telemetry.Metrics
	MetricsURL string

	opts    Options
	dataDir string
	tmpDir  string   // the throwaway DataDir, removed by Close
	tmpLock *os.File // holds tmpDir's lock
	dir     *dataDir // the kept DataDir, locked
	state   state    // what the DataDir remembers between runs
	nats    *server.Server
	nc      []*nats.Conn
	cancel  context.CancelFunc
	group   *errgroup.Group
	done    <-chan struct{} // closed when a service stopped or the stack is closing
	once    sync.Once
	err     error
	fleet   fleet
	// ownMetrics: Metrics is the stack's own, which Close shuts down.
	ownMetrics bool
}

// Start starts the embedded servers it needs, migrates the database, ensures
// the PKI and the root tenant, and starts every service. ctx bounds the
// start only: the stack runs until Close, which stops the machines before
// the services they talk to. On error nothing is left running.
func Start(ctx context.Context, o Options) (_ *Stack, err error) {
	if o.Gateways <= 0 && o.ExternalGatewayURL == "" {
		o.Gateways = 1
	}
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Logger == nil {
		o.Logger = telemetry.Discard()
	}
	if o.MachineLogger == nil {
		o.MachineLogger = telemetry.Discard()
	}
	if o.Clock == nil {
		o.Clock = clock.New()
	}
	if o.MaxConns == 0 {
		o.MaxConns = 40
	}
	ownMetrics := o.Metrics == nil
	if ownMetrics {
		m, err := telemetry.NewMetrics(ctx, telemetry.ExporterPrometheus, "better-compute-dev")
		if err != nil {
			return nil, err
		}
		o.Metrics = m
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &Stack{opts: o, cancel: cancel, dataDir: o.DataDir, Metrics: o.Metrics, ownMetrics: ownMetrics}
	defer func() {
		if err != nil {
			if o.APIListener != nil {
				o.APIListener.Close()
			}
			if o.JoinServiceControlListener != nil {
				o.JoinServiceControlListener.Close()
			}
			s.close(true)
		}
	}()
	sweepThrowaways()
	if s.dataDir == "" {
		if s.tmpDir, s.tmpLock, err = makeThrowaway(); err != nil {
			return nil, err
		}
		s.dataDir = s.tmpDir
	} else if s.dir, err = openDataDir(s.dataDir); err != nil {
		return nil, err
	}
	s.state = readState(s.dataDir)
	s.Instance = s.state.Instance
	if err := s.startServers(ctx); err != nil {
		return nil, err
	}
	if err := store.MigrateUp(s.DatabaseURL); err != nil {
		return nil, err
	}
	s.PKIDir = o.PKIDir
	if s.PKIDir == "" {
		s.PKIDir = filepath.Join(s.dataDir, DirPKI)
		if err := os.MkdirAll(s.PKIDir, 0o700); err != nil {
			return nil, err
		}
	}
	if _, err := pki.Init(s.PKIDir, pki.InitOptions{GatewayNames: []string{"localhost", "127.0.0.1"}}, o.Clock.Now()); err != nil {
		return nil, fmt.Errorf("devstack: pki: %w", err)
	}
	if s.Pins, err = pki.ReadPins(s.PKIDir); err != nil {
		return nil, fmt.Errorf("devstack: pins: %w", err)
	}
	s.ServicePKIDirs = map[string]string{}
	for _, name := range pki.Services() {
		dir := filepath.Join(s.dataDir, DirServicePKI, name)
		if _, err := pki.Export(s.PKIDir, name, dir); err != nil {
			return nil, fmt.Errorf("devstack: pki: %w", err)
		}
		s.ServicePKIDirs[name] = dir
	}
	if s.DB, err = store.Open(ctx, s.DatabaseURL, o.Clock, 30*time.Second, store.Options{MaxConns: o.MaxConns}); err != nil {
		return nil, err
	}
	if err := s.DB.RecordPoolStats(o.Metrics.Provider); err != nil {
		return nil, err
	}
	root, err := bootstrap.Root(ctx, s.DB, "", filepath.Join(s.dataDir, FileRootEnv))
	if err != nil {
		return nil, err
	}
	s.TenantID, s.RootToken, s.RootTokenMinted = root.TenantID, root.RootToken, root.RootTokenMinted

	g, gctx := errgroup.WithContext(runCtx)
	s.group, s.done = g, gctx.Done()
	if s.Postgres != nil {
		g.Go(func() error {
			select {
			case <-s.Postgres.Done():
				return errors.New("devstack: the embedded PostgreSQL server exited")
			case <-gctx.Done():
				return nil
			}
		})
	}
	if err := s.startServices(gctx, g); err != nil {
		return nil, err
	}
	return s, nil
}

// startServers starts the embedded NATS and PostgreSQL servers the options
// leave to the stack.
func (s *Stack) startServers(ctx context.Context) error {
	o := s.opts
	s.NATSURL = o.NATSURL
	if s.NATSURL != "" {
		// The services' connections retry forever: say at once when the
		// server cannot be reached at all.
		probe, err := nats.Connect(s.NATSURL, nats.Timeout(5*time.Second))
		if err != nil {
			return fmt.Errorf("devstack: nats %s: %w", s.NATSURL, err)
		}
		probe.Close()
	} else {
		ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoSigs: true, NoLog: true})
		if err != nil {
			return fmt.Errorf("devstack: nats: %w", err)
		}
		go ns.Start()
		if !ns.ReadyForConnections(10 * time.Second) {
			ns.Shutdown()
			return errors.New("devstack: the embedded NATS server did not start within 10s")
		}
		s.nats = ns
		s.NATSURL = ns.ClientURL()
	}
	s.DatabaseURL = o.DatabaseURL
	if s.DatabaseURL != "" {
		return nil
	}
	secret, err := readOrMakeSecret(filepath.Join(s.dataDir, FileSecret))
	if err != nil {
		return err
	}
	po := pgembed.Options{Password: secret, BinDir: o.PostgresBinDir, Clock: o.Clock}
	if s.tmpDir != "" {
		po.Memory = true
	} else {
		po.DataDir = filepath.Join(s.dataDir, DirPostgres)
	}
	if s.Postgres, err = pgembed.Start(ctx, po); err != nil {
		return err
	}
	s.DatabaseURL = s.Postgres.URL("postgres")
	return nil
}

// readOrMakeSecret returns the secret in path, making a random one (mode
// 0600) when the file is missing.
func readOrMakeSecret(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		if v := strings.TrimSpace(string(b)); v != "" {
			return v, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	var raw [24]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	v := hex.EncodeToString(raw[:])
	if err := os.WriteFile(path, []byte(v+"\n"), 0o600); err != nil {
		return "", err
	}
	return v, nil
}

// keepState writes the state of a kept stack to its DataDir.
func (s *Stack) keepState() error {
	if s.tmpDir != "" {
		return nil
	}
	return writeState(s.dataDir, s.state)
}

// listen listens on host:port, or on a free port when port is 0 or taken
// (then it adds a warning naming what).
func (s *Stack) listen(host string, port int, what string) (net.Listener, int, error) {
	if port > 0 {
		ln, err := net.Listen("tcp", net.JoinHostPort(host, fmt.Sprint(port)))
		if err == nil {
			return ln, port, nil
		}
		defer func() {
			s.Warnings = append(s.Warnings, fmt.Sprintf("the %s's port %d, kept from the last run, is taken (%s): "+
				"it listens on another, and machines that joined from outside this process must join again", what, port, errText(err)))
		}()
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, 0, err
	}
	return ln, ln.Addr().(*net.TCPAddr).Port, nil
}

// urlHost is the host to put in URLs for a listener on host: loopback for
// the unspecified address.
func urlHost(host string) string {
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		return "127.0.0.1"
	}
	return host
}

// startServices builds every service with New and runs it (its Run: the
// service lifecycle of pkg/service, as in the binaries) in g, on the
// stack's database and clock, each with a NATS connection of its own. No
// service runs probes servers of its own here; the API serves its probes
// beside its handler, as everywhere.
func (s *Stack) startServices(gctx context.Context, g *errgroup.Group) error {
	o := s.opts
	// The services share the database: its commits wake the outbox relay,
	// and the scheduler and gateways they poke, over NATS.
	signalNC, err := s.connect("outbox-signal")
	if err != nil {
		return err
	}
	s.DB.SignalOutboxVia(func() error { return signalNC.Publish(store.SubjectOutboxWritten, nil) })
	s.DB.PokeVia(bus.PublishWithID(signalNC, store.OutboxIDHeader))
	kept := s.state
	s.state.Gateways = nil
	host := urlHost(o.Host)
	pkiOf := func(name string) service.PKI { return service.PKI{PKIDir: s.ServicePKIDirs[name]} }
	intent := service.Intent{SignedIntent: o.SignedIntent}
	certs := service.NodeCerts{NodeCertTTL: o.NodeCertTTL}
	// JoinService's control listener, which the gateways renew
	// certificates through (mutual TLS, as in compose), is on loopback
	// only, whatever o.Host: only this process's gateways and those the
	// caller runs on this machine dial it. It is made first so that the
	// gateways know its URL; JoinService serves it once it runs.
	nodeCertLn, nodeCertServed := o.JoinServiceControlListener, false
	if nodeCertLn == nil {
		if nodeCertLn, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return err
		}
		// Start closes the caller's listener when it fails; this one is
		// closed here unless JoinService runs on it.
		defer func() {
			if !nodeCertServed {
				nodeCertLn.Close()
			}
		}()
	}
	s.JoinServiceControlURL = "https://" + nodeCertLn.Addr().String()

	for i := range o.Gateways {
		var want int
		if i < len(kept.Gateways) {
			want = kept.Gateways[i]
		}
		ln, port, err := s.listen(o.Host, want, fmt.Sprintf("gateway %d", i))
		if err != nil {
			return err
		}
		// Its control server (the API opens tunnels there) is on loopback
		// only, whatever o.Host: only this process's API dials it.
		control, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			ln.Close()
			return err
		}
		gw, err := run(s, g, gctx, fmt.Sprintf("gateway-%d", i), true, func(deps service.Deps) (*gateway.Server, error) {
			return gateway.New(gateway.Config{GatewayID: fmt.Sprintf("gw-dev-%s-%d", s.state.Instance, i), Listener: ln,
				ControlListener: control, Probes: service.Probes{NoHealthServer: true}, PKI: pkiOf(pki.ServiceGateway),
				JoinServiceURL: s.JoinServiceControlURL, HeartbeatInterval: o.HeartbeatInterval, ResyncInterval: o.ResyncInterval}, deps)
		})
		if err != nil {
			ln.Close()
			control.Close()
			return err
		}
		s.Gateways = append(s.Gateways, gw)
		s.GatewayURLs = append(s.GatewayURLs, "https://"+net.JoinHostPort(host, fmt.Sprint(port)))
		s.state.Gateways = append(s.state.Gateways, port)
	}

	// joinservice: machines are sent to every gateway (they start on one
	// and move to the next when they lose it).
	gateways := service.Gateways{GatewayURL: s.GatewayURL(), GatewayServerName: "localhost"}
	joinLn, joinPort, err := s.listen(o.Host, kept.Join, "JoinService")
	if err != nil {
		return err
	}
	if _, err := run(s, g, gctx, "joinservice", false, func(deps service.Deps) (*joinservice.Server, error) {
		// Every simulated machine joins from this host: a per-address
		// join limit would only slow a fleet of them down.
		return joinservice.New(joinservice.Config{PKI: pkiOf(pki.ServiceJoinService), NodeCerts: certs, Intent: intent,
			Gateways: gateways, Listener: joinLn, ControlListener: nodeCertLn, JoinBurst: devJoinLimit, JoinRate: devJoinLimit}, deps)
	}); err != nil {
		joinLn.Close()
		return err
	}
	nodeCertServed = true
	s.state.Join = joinPort
	s.JoinURL = "http://" + net.JoinHostPort(host, fmt.Sprint(joinPort))
	if err := s.keepState(); err != nil {
		return err
	}

	// api, after joinservice and the gateways, whose URLs its well-known
	// document publishes.
	apiLn := o.APIListener
	if apiLn == nil {
		if apiLn, _, err = s.listen(o.Host, 0, "API"); err != nil {
			return err
		}
	}
	s.APIURL = "http://" + net.JoinHostPort(host, fmt.Sprint(apiLn.Addr().(*net.TCPAddr).Port))
	if s.Metrics.Handler != nil {
		s.MetricsURL = s.APIURL + "/metrics"
	}
	if _, err := run(s, g, gctx, "api", true, func(deps service.Deps) (*api.Server, error) {
		return api.New(api.Config{PKI: pkiOf(pki.ServiceAPI), Intent: intent, Listener: apiLn, WellKnown: api.WellKnownConfig{
			PublicURL: s.APIURL, JoinURL: s.JoinURL, Gateways: gateways}, TicketBurst: o.TicketBurst, TicketRate: o.TicketRate}, deps)
	}); err != nil {
		apiLn.Close()
		return err
	}

	if !o.NoControllers {
		if s.Controllers, err = run(s, g, gctx, "controllers", true, func(deps service.Deps) (*controllers.Server, error) {
			return controllers.New(controllers.Config{Probes: service.Probes{NoHealthServer: true}, PKI: pkiOf(pki.ServiceControllers), Intent: intent,
				Leases: service.Leases{Holder: "dev-" + s.state.Instance + "-controllers"}, ReconcileInterval: o.ReconcileInterval}, deps)
		}); err != nil {
			return err
		}
	}
	if !o.NoScheduler {
		if s.Scheduler, err = run(s, g, gctx, "scheduler", true, func(deps service.Deps) (*scheduler.Server, error) {
			return scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, PKI: pkiOf(pki.ServiceScheduler), Intent: intent,
				Leases: service.Leases{Holder: "dev-" + s.state.Instance + "-scheduler"}}, deps)
		}); err != nil {
			return err
		}
	}
	return nil
}

// connect opens a NATS connection named name, closed by Close.
func (s *Stack) connect(name string) (*nats.Conn, error) {
	nc, err := bus.Connect(s.NATSURL, name, s.opts.Logger)
	if err == nil {
		s.nc = append(s.nc, nc)
	}
	return nc, err
}

// run builds the service name with New (build) on the stack's database,
// clock and logger (and, with withNATS, a NATS connection of its own), and
// runs it in g until gctx ends.
func run[R service.Runner](s *Stack, g *errgroup.Group, gctx context.Context, name string, withNATS bool,
	build func(service.Deps) (R, error)) (R, error) {
	svcName, _, _ := strings.Cut(name, "-") // gateway-1 is a gateway
	deps := service.Deps{DB: s.DB, Logger: s.opts.Logger.With("service", svcName), Clock: s.opts.Clock, Metrics: s.opts.Metrics}
	if withNATS {
		var err error
		if deps.NC, err = s.connect(name); err != nil {
			var zero R
			return zero, err
		}
	}
	svc, err := build(deps)
	if err != nil {
		return svc, err
	}
	g.Go(func() error { return svc.Run(gctx) })
	return svc, nil
}

// GatewayURL is where joining machines are sent: the gateways' URLs
// separated by commas (Options.ExternalGatewayURL when set).
func (s *Stack) GatewayURL() string {
	if s.opts.ExternalGatewayURL != "" {
		return s.opts.ExternalGatewayURL
	}
	return strings.Join(s.GatewayURLs, ",")
}

// Done is closed when the stack stops: Close was called, or a service (or
// the embedded PostgreSQL server) stopped on its own; Err then says why.
func (s *Stack) Done() <-chan struct{} { return s.done }

// Err returns nil while the stack runs; after Done, the error a service
// stopped with (nil when it was closed).
func (s *Stack) Err() error {
	select {
	case <-s.done:
	default:
		return nil
	}
	err := s.group.Wait()
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// DataDir is the directory the stack keeps its state in (Options.DataDir,
// or the throwaway directory Close removes).
func (s *Stack) DataDir() string { return s.dataDir }

// BootstrapOptions say what Bootstrap creates; zero values take
// compose's defaults (pool accepting 8x H100, a join token of 1,000 uses).
type BootstrapOptions struct {
	GPUModel    string
	ExpectGPUs  int32
	JoinMaxUses int32
	// Dir receives the join-token and root.env files (default: a new
	// directory in DataDir).
	Dir string
}

// Bootstrap creates (or reuses) the root tenant and token, site dev-1, a
// metal-host pool and a join token, as compose's one-shot does.
func (s *Stack) Bootstrap(ctx context.Context, bo BootstrapOptions) (bootstrap.Result, error) {
	o := bootstrap.Defaults()
	if bo.GPUModel != "" {
		o.GPUModel = bo.GPUModel
	}
	if bo.ExpectGPUs != 0 {
		o.ExpectGPUs = bo.ExpectGPUs
	}
	if bo.JoinMaxUses != 0 {
		o.JoinMaxUses = bo.JoinMaxUses
	}
	dir := bo.Dir
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp(s.dataDir, "bootstrap-"); err != nil {
			return bootstrap.Result{}, err
		}
	}
	o.JoinTokenFile = filepath.Join(dir, "join-token")
	o.EnvFile = filepath.Join(dir, "root.env")
	return bootstrap.Run(ctx, s.DB, o)
}

// Close stops the simulated machines, then every service (releasing their
// leases), then the embedded servers, removes a throwaway DataDir and
// unlocks a kept one. It returns the first error a service stopped with.
// Calling it again does nothing.
func (s *Stack) Close() error {
	s.close(false)
	return s.err
}

// close is Close; failedStart also removes a kept DataDir that Start made.
func (s *Stack) close(failedStart bool) {
	s.once.Do(func() {
		s.fleet.stop()
		s.cancel()
		if s.group != nil {
			s.err = s.group.Wait()
			if errors.Is(s.err, context.Canceled) {
				s.err = nil
			}
		}
		for _, nc := range s.nc {
			nc.Close()
		}
		if s.DB != nil {
			s.DB.Close()
		}
		if s.Postgres != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			if err := s.Postgres.Stop(ctx); err != nil && s.err == nil {
				s.err = err
			}
			cancel()
		}
		if s.nats != nil {
			s.nats.Shutdown()
			s.nats.WaitForShutdown()
		}
		if s.ownMetrics {
			_ = s.Metrics.Shutdown(context.Background())
		}
		if s.tmpDir != "" {
			if err := os.RemoveAll(s.tmpDir); err != nil && s.err == nil {
				s.err = err
			}
			s.tmpLock.Close()
		}
		if s.dir != nil {
			s.dir.close(failedStart)
		}
	})
}
