package service

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/net/netutil"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Runner is the one contract of everything long-running in a service: the
// service itself, its reconcilers, the outbox relay, its HTTP servers. Run
// works until ctx ends, then releases what it holds (leases,
// subscriptions, listeners) and returns nil; an error it returns before
// then stops the whole service (Run of this package). Name names it in logs
// and errors, and a reconciler's lease (controllers: "controllers." + its
// name).
type Runner interface {
	Name() string
	Run(ctx context.Context) error
}

// Starter is a Runner with work that must be done before any part of its
// service serves (the gateway clears the sessions of its previous run and
// subscribes to its pokes before it accepts one). Run calls Start of every
// part that has it, in order, before it runs any; a part whose Start
// succeeded is always Run afterwards, with a context that may have ended
// already, so that Run releases what Start took.
type Starter interface {
	Start(ctx context.Context) error
}

// ShutdownTimeout is how long Run waits, once its context ended, for a
// service's parts to stop, in all: 30 s. Each HTTP server's requests in
// flight get up to 10 s of it (Serve).
const ShutdownTimeout = 30 * time.Second

// Spec is a service as Run runs it. A service's package builds it from its
// Config and Deps; see pkg/service's doc for the order of things.
type Spec struct {
	// Name names the service in errors.
	Name string
	// Deps are the service's dependencies: Run logs to Deps.Logger, and
	// GET /readyz checks that Deps.DB answers a ping and Deps.NC is
	// connected (each when set).
	Deps Deps
	// Parts run alongside the servers, started first and stopped last, in
	// the reverse of this order: each stops after the parts listed after it
	// returned.
	Parts []Runner
	// Servers are the service's HTTP servers, listening before anything
	// else starts (a busy port fails the service before it touched
	// anything) and stopping before any part, in the reverse of this
	// order.
	Servers []HTTPServer
	// Ready are checks of GET /readyz besides the dependencies'.
	Ready []Check
}

// HTTPServer is an HTTP server of a service. Run builds it (NewServer:
// HTTP/1.1 and HTTP/2, the timeouts and stream cap of Limits), listens,
// accepting at most Limits.HTTPMaxConnections connections at once, serves
// and shuts it down (Serve: up to 10 s for requests in flight).
type HTTPServer struct {
	// Name names the server in logs and errors ("sessions", "health").
	Name string
	// Addr is where it listens when Listener is nil.
	Addr string
	// Listener, when set, is where it accepts connections; Run closes it.
	Listener net.Listener
	// Handler serves its requests; nil with Probes serves the probes only.
	Handler http.Handler
	// Probes mounts GET /healthz (alive: 200 "ok" while the process
	// serves), GET /readyz (ready: 200 "ok" when every check of the
	// Spec passes within 2 s, else 503 naming the first failure) and, when
	// Deps.Metrics has a Prometheus handler, GET /metrics (docs/metrics.md)
	// before Handler.
	Probes bool
	// TLS, when set, makes it serve TLS (ServeTLS) with this configuration.
	TLS *tls.Config
	// Limits are its timeouts and caps; a zero field is its default.
	Limits HTTPLimits
	// Tune, when set, adjusts the server before it serves (protocols, HTTP/2
	// settings, timeouts of long-lived streams).
	Tune func(*http.Server)
	// WrapListener, when set, wraps the listener (after the connection cap)
	// before the server accepts from it: a server that does its own TLS
	// handshakes and serves some connections itself (the gateway's framed
	// sessions) returns only the others from Accept.
	WrapListener func(net.Listener) net.Listener
	// OnShutdown, when set, runs when the server starts shutting down, before
	// it waits for the requests in flight: it ends long streams, so that the
	// shutdown does not wait for them. It must not block.
	OnShutdown func()
}

// Run runs a service until ctx ends or a part fails: it opens every
// server's listener, calls Start of every part that has one, in order, then
// runs every part and server in an errgroup; when ctx ends or one returns
// an error, it stops the servers, then the parts, each in the reverse of
// its order, within ShutdownTimeout. It returns nil after a stop by ctx,
// else the first error, "NAME: …" with the failing part's name.
func Run(ctx context.Context, s Spec) error {
	d := s.Deps.withDefaults()
	log := d.Logger
	ready := HealthHandler(append(d.checks(), s.Ready...)...)
	servers := make([]*httpPart, len(s.Servers))
	for i, h := range s.Servers {
		h.Limits = h.Limits.withDefaults()
		servers[i] = &httpPart{spec: h, log: log, srv: h.build(ready, metricsHandler(d.Metrics))}
	}
	// all runs in this order and stops in the reverse; servers start first.
	all := append(slices.Clone(s.Parts), asRunners(servers)...)
	startOrder := make([]int, 0, len(all))
	for i := range all {
		startOrder = append(startOrder, (i+len(s.Parts))%len(all))
	}
	started := make([]bool, len(all))
	var startErr error
	for _, i := range startOrder {
		if st, ok := all[i].(Starter); ok {
			if err := st.Start(ctx); err != nil {
				startErr = fmt.Errorf("%s: %w", all[i].Name(), err)
				break
			}
		}
		started[i] = true
	}

	if startErr == nil {
		log.Info("service starting", "parts", names(all))
	}
	g, failed := errgroup.WithContext(context.WithoutCancel(ctx))
	stops := make([]func(), len(all))
	dones := make([]chan struct{}, len(all))
	for i, r := range all {
		if !started[i] {
			continue
		}
		pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		stops[i], dones[i] = cancel, make(chan struct{})
		if startErr != nil {
			cancel()
		}
		g.Go(func() error {
			defer close(dones[i])
			if err := r.Run(pctx); err != nil {
				return fmt.Errorf("%s: %w", r.Name(), err)
			}
			return nil
		})
	}
	if startErr == nil {
		select {
		case <-ctx.Done():
		case <-failed.Done():
		}
	}

	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
	defer cancel()
	var stuck []string
	for i := len(all) - 1; i >= 0; i-- {
		if stops[i] == nil {
			continue
		}
		stops[i]()
		if len(stuck) > 0 {
			continue // out of time: stop the rest without waiting
		}
		select {
		case <-dones[i]:
		case <-sctx.Done():
			stuck = append(stuck, all[i].Name())
		}
	}
	if len(stuck) > 0 {
		log.Error("service did not stop in time", "timeout", ShutdownTimeout.String(), "part", stuck[0])
		return errors.Join(startErr, fmt.Errorf("%s: %s did not stop within %s", s.Name, stuck[0], ShutdownTimeout))
	}
	err := errors.Join(startErr, g.Wait())
	log.Info("service stopped")
	return err
}

func asRunners(servers []*httpPart) []Runner {
	out := make([]Runner, len(servers))
	for i, s := range servers {
		out[i] = s
	}
	return out
}

func names(rs []Runner) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.Name()
	}
	return out
}

// metricsHandler is GET /metrics of m: nil without a Prometheus exporter.
func metricsHandler(m *telemetry.Metrics) http.Handler {
	if m == nil {
		return nil
	}
	return m.Handler
}

// build returns the http.Server of h, with the probes answering ready
// when asked and GET /metrics serving metrics when it is not nil.
func (h HTTPServer) build(ready, metrics http.Handler) *http.Server {
	handler := h.Handler
	if h.Probes {
		mux := http.NewServeMux()
		mux.Handle("/healthz", HealthHandler())
		mux.Handle("/readyz", ready)
		if metrics != nil {
			mux.Handle("GET /metrics", metrics)
		}
		if h.Handler != nil {
			mux.Handle("/", h.Handler)
		}
		handler = mux
	}
	srv := NewServer(h.Addr, handler, h.Limits)
	srv.TLSConfig = h.TLS
	if h.Tune != nil {
		h.Tune(srv)
	}
	return srv
}

// httpPart runs an HTTPServer: Start listens, Run serves.
type httpPart struct {
	spec HTTPServer
	log  *slog.Logger
	srv  *http.Server
	ln   net.Listener
}

func (h *httpPart) Name() string { return h.spec.Name + " server" }

// Start listens (or takes the spec's Listener), accepting at most
// HTTPMaxConnections connections at once: the next waits, unaccepted, until
// one closes.
func (h *httpPart) Start(context.Context) error {
	ln := h.spec.Listener
	if ln == nil {
		var err error
		if ln, err = Listen(h.spec.Addr); err != nil {
			return fmt.Errorf("listen %s: %w", h.spec.Addr, err)
		}
	}
	h.ln = netutil.LimitListener(ln, h.spec.Limits.HTTPMaxConnections)
	if h.spec.WrapListener != nil {
		h.ln = h.spec.WrapListener(h.ln)
	}
	return nil
}

func (h *httpPart) Run(ctx context.Context) error {
	if ctx.Err() != nil {
		return h.ln.Close()
	}
	if h.spec.OnShutdown == nil {
		return Serve(ctx, h.log.With("server", h.spec.Name), h.srv, h.ln)
	}
	// OnShutdown runs, and returns, before Serve starts the shutdown
	// (http.Server.RegisterOnShutdown would run it in a goroutine of its own,
	// in no order with what the lifecycle stops next).
	serveCtx, shutdown := context.WithCancel(context.WithoutCancel(ctx))
	served := make(chan struct{})
	defer close(served)
	go func() {
		select {
		case <-ctx.Done():
			h.spec.OnShutdown()
			shutdown()
		case <-served:
			shutdown()
		}
	}()
	return Serve(serveCtx, h.log.With("server", h.spec.Name), h.srv, h.ln)
}

// Func returns a Runner named name that runs run.
func Func(name string, run func(ctx context.Context) error) Runner { return funcRunner{name, run} }

type funcRunner struct {
	name string
	run  func(ctx context.Context) error
}

func (f funcRunner) Name() string                  { return f.name }
func (f funcRunner) Run(ctx context.Context) error { return f.run(ctx) }

// OnStop returns a Runner named name that waits for its context to end and
// then calls stop: what a service releases once the parts after it (its
// servers) stopped, such as the API's command queue.
func OnStop(name string, stop func()) Runner {
	return Func(name, func(ctx context.Context) error {
		<-ctx.Done()
		stop()
		return nil
	})
}

// Leased returns r run behind l (lease.Lease.Run): r runs while this
// replica holds the lease, is stopped when it loses it, and the lease is
// released when the context ends. Its name is r's.
func Leased(l *lease.Lease, r Runner) Runner {
	return Func(r.Name(), func(ctx context.Context) error { return l.Run(ctx, r.Run) })
}

// Deps are a service's dependencies, handed to its New: Main opens them
// for a service binary (per its Config: Database, NATS), pkg/devstack
// shares its own between the services of one process.
type Deps struct {
	// DB is the database; every service needs it.
	DB *store.DB
	// NC is the NATS connection; see each service for whether it needs
	// one.
	NC *nats.Conn
	// Logger receives the service's logs; nil discards them.
	Logger *slog.Logger
	// Clock is the service's clock; nil is DB.Clock, else the real clock.
	Clock clock.Clock
	// Metrics is where the service's instruments are made (Meter) and, with
	// the prometheus exporter, what GET /metrics of its probes serves; nil
	// is the global MeterProvider and no /metrics. Main sets it from
	// BETTER_COMPUTE_METRICS_EXPORTER (telemetry.SetupMetrics);
	// pkg/devstack shares one between the services of its process.
	Metrics *telemetry.Metrics
}

// Meter returns the meter named name (the instrumenting package's import
// path) of d.Metrics.
func (d Deps) Meter(name string) metric.Meter { return d.Metrics.Meter(name) }

// Complete returns d with its defaults filled in (a discarding Logger, the
// DB's or the real Clock), or an error naming service when the database,
// or with needNATS the NATS connection, is missing.
func (d Deps) Complete(service string, needNATS bool) (Deps, error) {
	if d.DB == nil {
		return d, fmt.Errorf("%s: Deps.DB, the database, is required", service)
	}
	if needNATS && d.NC == nil {
		return d, fmt.Errorf("%s: Deps.NC, the NATS connection, is required", service)
	}
	return d.withDefaults(), nil
}

func (d Deps) withDefaults() Deps {
	if d.Logger == nil {
		d.Logger = telemetry.Discard()
	}
	if d.Clock == nil && d.DB != nil {
		d.Clock = d.DB.Clock
	}
	if d.Clock == nil {
		d.Clock = clock.New()
	}
	return d
}

// errDatabaseUnreachable is GET /readyz's reason when the database does not
// answer; the database's own error is logged.
var errDatabaseUnreachable = errors.New("database unreachable")

// checks are the readiness checks of d: the database answers a ping, NATS
// is connected (each when set).
func (d Deps) checks() []Check {
	var checks []Check
	if d.DB != nil {
		checks = append(checks, func(ctx context.Context) error {
			if err := d.DB.Pool.Ping(ctx); err != nil {
				d.Logger.WarnContext(ctx, "not ready: the database does not answer", telemetry.KeyError, err)
				return errDatabaseUnreachable
			}
			return nil
		})
	}
	if d.NC != nil {
		checks = append(checks, func(context.Context) error {
			if !d.NC.IsConnected() {
				return errors.New("nats not connected")
			}
			return nil
		})
	}
	return checks
}

// Listen listens on TCP address addr (host:port). A host name that
// resolves to several addresses listens on the first of them that is this
// machine's: a network alias of a replicated compose service (JoinService's
// joinservice-control) resolves to every replica's address, and each
// replica must bind its own. An IP or an empty host is listened on as it
// is (net.Listen).
func Listen(addr string) (net.Listener, error) {
	return listen(addr, net.DefaultResolver.LookupHost)
}

func listen(addr string, lookupHost func(ctx context.Context, host string) ([]string, error)) (net.Listener, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host == "" || net.ParseIP(host) != nil {
		return net.Listen("tcp", addr)
	}
	ips, err := lookupHost(context.Background(), host)
	if err != nil || len(ips) < 2 {
		return net.Listen("tcp", addr)
	}
	var errs []error
	for _, ip := range ips {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, port))
		if err == nil {
			return ln, nil
		}
		errs = append(errs, err)
	}
	return nil, fmt.Errorf("none of the addresses of %s is this machine's: %w", host, errors.Join(errs...))
}
