// Package devstack runs the whole better-compute control plane in one process
// on loopback: api, joinservice, N gateways, scheduler and controllers, the
// same packages the service binaries run, against a Postgres and a NATS that
// the caller provides. The integration suites and benchmarks of tests/ use it,
// and `better-compute dev` can.
//
// Start migrates the database and creates the PKI directory when needed;
// Bootstrap creates the root tenant, a pool and a join token; Close stops
// every service and waits for them.
package devstack

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/bootstrap"
	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/controllers/controllers"
	"github.com/better-compute/better-compute/services/gateway/gateway"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// Options configure Start.
type Options struct {
	// DatabaseURL is a postgres:// URL; Start migrates it up. Required.
	DatabaseURL string
	// NATSURL is the NATS server. Required.
	NATSURL string
	// PKIDir holds the deployment's keys; created with pki.Init when
	// missing. Required.
	PKIDir string
	// Gateways is how many gateway replicas to run (default 1, or 0 when
	// ExternalGatewayURL is set).
	Gateways int
	// ExternalGatewayURL, when set, is the gateway joined machines are sent
	// to (gateways run outside this process, e.g. to measure their memory or
	// kill one): one https:// URL or several separated by commas; their TLS
	// name must be "localhost".
	ExternalGatewayURL string
	// Host is the address services listen on (default 127.0.0.1), each on a
	// free port.
	Host string
	// Logger receives every service's logs (default: discarded).
	Logger *slog.Logger
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
	// JoinURL is JoinService's base URL.
	JoinURL string
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

	opts   Options
	nc     []*nats.Conn
	cancel context.CancelFunc
	group  *errgroup.Group
	once   sync.Once
	err    error
}

func listen(host string) (net.Listener, string, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, "", err
	}
	return ln, ln.Addr().String(), nil
}

// Start migrates the database, ensures the PKI, and starts every service. The
// services stop when ctx ends or Close is called.
func Start(ctx context.Context, o Options) (_ *Stack, err error) {
	if o.DatabaseURL == "" || o.NATSURL == "" || o.PKIDir == "" {
		return nil, errors.New("devstack: DatabaseURL, NATSURL and PKIDir are required")
	}
	if o.Gateways <= 0 && o.ExternalGatewayURL == "" {
		o.Gateways = 1
	}
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Logger == nil {
		o.Logger = telemetry.Discard()
	}
	if o.Clock == nil {
		o.Clock = clock.New()
	}
	if o.MaxConns == 0 {
		o.MaxConns = 40
	}
	if o.NodeCertTTL <= 0 {
		o.NodeCertTTL = joinservice.DefaultNodeCertTTL
	}
	if err := store.MigrateUp(o.DatabaseURL); err != nil {
		return nil, err
	}
	if _, err := pki.Init(o.PKIDir, pki.InitOptions{GatewayNames: []string{"localhost", "127.0.0.1"}}, o.Clock.Now()); err != nil {
		return nil, fmt.Errorf("devstack: pki: %w", err)
	}
	db, err := store.Open(ctx, o.DatabaseURL, o.Clock, 30*time.Second, store.Options{MaxConns: o.MaxConns})
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &Stack{DB: db, opts: o, cancel: cancel}
	defer func() {
		if err != nil {
			_ = s.Close()
		}
	}()
	g, gctx := errgroup.WithContext(runCtx)
	s.group = g
	go func() {
		select {
		case <-ctx.Done():
			cancel()
		case <-gctx.Done():
		}
	}()
	connect := func(name string) (*nats.Conn, error) {
		nc, err := bus.Connect(o.NATSURL, name, o.Logger)
		if err == nil {
			s.nc = append(s.nc, nc)
		}
		return nc, err
	}
	log := func(svc string) *slog.Logger { return o.Logger.With("service", svc) }
	// The services share db: its commits wake the outbox relay over NATS.
	signalNC, err := connect("outbox-signal")
	if err != nil {
		return nil, err
	}
	db.SignalOutboxVia(func() error { return signalNC.Publish(store.SubjectOutboxWritten, nil) })

	// gateways
	for i := range o.Gateways {
		nc, err := connect(fmt.Sprintf("gateway-%d", i))
		if err != nil {
			return nil, err
		}
		ln, addr, err := listen(o.Host)
		if err != nil {
			return nil, err
		}
		gw, err := gateway.New(gateway.Config{
			GatewayID:         fmt.Sprintf("gw-dev-%d", i),
			Listener:          ln,
			PKIDir:            o.PKIDir,
			HeartbeatInterval: o.HeartbeatInterval,
			ResyncInterval:    o.ResyncInterval,
			NodeCertTTL:       o.NodeCertTTL,
		}, gateway.Deps{DB: db, NC: nc, Logger: log("gateway"), Clock: o.Clock})
		if err != nil {
			ln.Close()
			return nil, err
		}
		s.Gateways = append(s.Gateways, gw)
		s.GatewayURLs = append(s.GatewayURLs, "https://"+addr)
		g.Go(func() error { return gw.Run(gctx) })
	}

	// joinservice: machines are sent to every gateway (they start on one
	// and move to the next when they lose it).
	gatewayURL := o.ExternalGatewayURL
	if gatewayURL == "" {
		gatewayURL = strings.Join(s.GatewayURLs, ",")
	}
	join, err := joinservice.New(joinservice.Config{
		PKIDir:            o.PKIDir,
		NodeCertTTL:       o.NodeCertTTL,
		SignedIntent:      o.SignedIntent,
		GatewayURL:        gatewayURL,
		GatewayServerName: "localhost",
	}, joinservice.Deps{DB: db, Logger: log("joinservice")})
	if err != nil {
		return nil, err
	}
	joinLn, joinAddr, err := listen(o.Host)
	if err != nil {
		return nil, err
	}
	s.JoinURL = "http://" + joinAddr
	g.Go(func() error { return join.Serve(gctx, joinLn) })

	// api, after joinservice and the gateways, whose URLs its well-known
	// document publishes.
	apiLn, apiAddr, err := listen(o.Host)
	if err != nil {
		return nil, err
	}
	s.APIURL = "http://" + apiAddr
	apiNC, err := connect("api")
	if err != nil {
		apiLn.Close()
		return nil, err
	}
	apiSrv, err := api.New(api.Config{SignedIntent: o.SignedIntent, WellKnown: api.WellKnownConfig{
		PKIDir: o.PKIDir, PublicURL: s.APIURL, JoinURL: s.JoinURL, GatewayURL: gatewayURL, GatewayServerName: "localhost",
	}}, api.Deps{DB: db, Logger: log("api"), NC: apiNC, Clock: o.Clock})
	if err != nil {
		apiLn.Close()
		return nil, err
	}
	g.Go(func() error { return apiSrv.Serve(gctx, apiLn) })
	if s.Pins, err = pki.ReadPins(o.PKIDir); err != nil {
		return nil, fmt.Errorf("devstack: pins: %w", err)
	}

	// controllers
	if !o.NoControllers {
		nc, err := connect("controllers")
		if err != nil {
			return nil, err
		}
		ctrl, err := controllers.New(controllers.Config{
			NoHealthServer:    true,
			ReconcileInterval: o.ReconcileInterval,
			Holder:            "dev-controllers",
			SignedIntent:      o.SignedIntent,
			PKIDir:            o.PKIDir,
		}, controllers.Deps{DB: db, NC: nc, Logger: log("controllers"), Clock: o.Clock})
		if err != nil {
			return nil, err
		}
		s.Controllers = ctrl
		g.Go(func() error { return ctrl.Run(gctx) })
	}

	// scheduler
	if o.NoScheduler {
		return s, nil
	}
	nc, err := connect("scheduler")
	if err != nil {
		return nil, err
	}
	sched, err := scheduler.New(scheduler.Config{NoHealthServer: true, Holder: "dev-scheduler",
		SignedIntent: o.SignedIntent, PKIDir: o.PKIDir},
		scheduler.Deps{DB: db, NC: nc, Logger: log("scheduler"), Clock: o.Clock})
	if err != nil {
		return nil, err
	}
	s.Scheduler = sched
	g.Go(func() error { return sched.Run(gctx) })
	return s, nil
}

// BootstrapOptions say what Bootstrap creates; zero values take
// compose's defaults (pool accepting 8x H100, a join token of 1,000 uses).
type BootstrapOptions struct {
	GPUModel    string
	ExpectGPUs  int32
	JoinMaxUses int32
	// Dir receives the join-token and root.env files (default: a new
	// temporary directory).
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
		if dir, err = os.MkdirTemp("", "bc-devstack-"); err != nil {
			return bootstrap.Result{}, err
		}
	}
	o.JoinTokenFile = filepath.Join(dir, "join-token")
	o.EnvFile = filepath.Join(dir, "root.env")
	return bootstrap.Run(ctx, s.DB, o)
}

// Close stops every service, waits for them and closes connections. It
// returns the first error a service stopped with.
func (s *Stack) Close() error {
	s.once.Do(func() {
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
		s.DB.Close()
	})
	return s.err
}
