// Package controllers runs better-compute's reconcilers: the outbox relay,
// the acceptance reconciler (joining → accepting → adopted or
// acceptance_failed, see Acceptance), the expiry of reservations at their
// end time (Expiry), the expiry of user commands at their deadline
// (CommandExpiry, behind LeaseCommandExpiry) and the usage sink (Usage). N
// replicas may run:
//
//   - The acceptance reconciler runs behind the lease LeaseAcceptance, so one
//     replica works at a time and another takes over within a lease TTL when
//     it dies. Its transactions claim nodes with FOR UPDATE SKIP LOCKED and
//     guard every transition on the node's state, so an overlap during a
//     takeover (a stalled holder still running) does no harm.
//   - Expiry, Usage and the liveness sweeper (Liveness) run behind the
//     leases LeaseExpiry, LeaseUsage and LeaseLiveness.
//     Expiry claims reservations with SKIP LOCKED and ends them with
//     store.EndReservation, which leaves an ended one alone; Usage writes
//     windows with ON CONFLICT DO NOTHING. An overlap does no harm.
//   - The outbox relay runs on every replica without a lease: it takes rows
//     with FOR UPDATE SKIP LOCKED, so replicas share the work instead of
//     waiting on each other, and a dead replica delays no poke by a lease
//     TTL. Pokes are idempotent hints, so the rare double publish is
//     harmless.
//
// To add a reconciler, give it a Run(ctx) error that stops on cancel, and
// start it in Server.Run behind a lease.Lease of its own name (or explain why
// it needs none).
package controllers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/outbox"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Defaults of Config.
const (
	DefaultListen             = ":8084"
	DefaultAcceptanceTimeout  = 2 * time.Minute
	DefaultReconcileInterval  = 2 * time.Second
	DefaultAcceptanceAttempts = 3
	DefaultBatchSize          = 500
	DefaultLeaseTTL           = lease.DefaultTTL
	DefaultPKIDir             = "/var/lib/better-compute/pki"
)

// LeaseAcceptance is the lease name of the acceptance reconciler.
const LeaseAcceptance = "controllers.acceptance"

// Config configures the controllers. Zero fields take the defaults above.
type Config struct {
	// Listen is the address of the HTTP server answering GET /healthz (env
	// BC_LISTEN, DefaultListen); unused when Listener is set.
	Listen string
	// Listener, when set, is where the health server accepts connections;
	// Run closes it.
	Listener net.Listener
	// NoHealthServer runs no health server (for `better-compute dev` and
	// tests, which mount HealthHandler elsewhere or not at all).
	NoHealthServer bool
	// AcceptanceTimeout is how long a node has to answer its acceptance
	// command (its deadline; env BC_ACCEPTANCE_TIMEOUT, 2 min).
	AcceptanceTimeout time.Duration
	// AcceptanceAttempts is how many acceptance commands a node gets before
	// it fails for not answering (3).
	AcceptanceAttempts int
	// ReconcileInterval is how often the reconcilers look for work without
	// a poke (env BC_RECONCILE_INTERVAL, 2 s).
	ReconcileInterval time.Duration
	// BatchSize is how many nodes one reconciler transaction handles (500).
	BatchSize int
	// LeaseTTL is the TTL of the reconcilers' leases (env BC_LEASE_TTL,
	// 15 s): a dead replica's work resumes elsewhere within about this long.
	LeaseTTL time.Duration
	// Holder names this replica in the leases table (env BC_LEASE_HOLDER,
	// lease.DefaultHolder()).
	Holder string
	// SignedIntent signs every command and NodeSpec the controllers write
	// with the command-signing root (env BC_SIGNED_INTENT; see pkg/store
	// IntentSigner). The key is read from PKIDir.
	SignedIntent bool
	// PKIDir holds command-signing.key (env BC_PKI_DIR, DefaultPKIDir); read
	// only with SignedIntent.
	PKIDir string
	// ExpiryInterval is how often reservations past their end, and user
	// commands past their deadline, are expired (env BC_EXPIRY_INTERVAL,
	// 1 s).
	ExpiryInterval time.Duration
	// UsageInterval is how often the usage sink writes final windows (env
	// BC_USAGE_INTERVAL, 1 min).
	UsageInterval time.Duration
	// LivenessTimeout is how long a node may go unheard before it is marked
	// unreachable (env BC_LIVENESS_TIMEOUT, DefaultLivenessTimeout 30 s; at
	// least store.MinLivenessTimeout, 20 s, which I4 needs).
	LivenessTimeout time.Duration
	// LivenessInterval is how often the liveness sweeper looks (env
	// BC_LIVENESS_INTERVAL, DefaultLivenessInterval 1 s).
	LivenessInterval time.Duration
}

// Deps are the controllers' dependencies.
type Deps struct {
	// DB is the database; required.
	DB *store.DB
	// NC publishes the outbox and carries pokes; required.
	NC *nats.Conn
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
}

// Server runs the controllers of one replica.
type Server struct {
	cfg        Config
	db         *store.DB
	nc         *nats.Conn
	log        *slog.Logger
	clk        clock.Clock
	acceptance *Acceptance
	lease      *lease.Lease
	expiry     *Expiry
	usage      *Usage
	liveness   *Liveness
	leases     []*lease.Lease // expiry, usage, liveness

	// commandExpiry runs behind commandLease (LeaseCommandExpiry).
	commandExpiry *CommandExpiry
	commandLease  *lease.Lease
}

// New checks cfg and deps and returns a Server; it starts nothing.
func New(cfg Config, deps Deps) (*Server, error) {
	if deps.DB == nil {
		return nil, errors.New("controllers: Deps.DB is required")
	}
	if deps.NC == nil {
		return nil, errors.New("controllers: Deps.NC is required")
	}
	if deps.Logger == nil {
		deps.Logger = telemetry.Discard()
	}
	if deps.Clock == nil {
		deps.Clock = deps.DB.Clock
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.Holder == "" {
		cfg.Holder = lease.DefaultHolder()
	}
	if cfg.PKIDir == "" {
		cfg.PKIDir = DefaultPKIDir
	}
	if cfg.LivenessTimeout != 0 && cfg.LivenessTimeout < store.MinLivenessTimeout {
		return nil, fmt.Errorf("controllers: LivenessTimeout %s is below %s, which I4 needs", cfg.LivenessTimeout,
			store.MinLivenessTimeout)
	}
	var intent *store.IntentSigner
	if cfg.SignedIntent {
		var err error
		if intent, err = store.LoadIntentSigner(cfg.PKIDir); err != nil {
			return nil, fmt.Errorf("controllers: %w", err)
		}
	}
	s := &Server{cfg: cfg, db: deps.DB, nc: deps.NC, log: deps.Logger, clk: deps.Clock}
	s.acceptance = &Acceptance{
		DB:       deps.DB,
		NC:       deps.NC,
		Logger:   deps.Logger.With("reconciler", "acceptance"),
		Clock:    deps.Clock,
		Timeout:  cfg.AcceptanceTimeout,
		Attempts: cfg.AcceptanceAttempts,
		Interval: cfg.ReconcileInterval,
		Batch:    cfg.BatchSize,
		Intent:   intent,
	}
	s.lease = &lease.Lease{DB: deps.DB, Name: LeaseAcceptance, Holder: cfg.Holder, TTL: cfg.LeaseTTL,
		Clock: deps.Clock, Logger: deps.Logger}
	s.expiry = &Expiry{DB: deps.DB, Logger: deps.Logger.With("reconciler", "expiry"), Clock: deps.Clock,
		Interval: cfg.ExpiryInterval, Batch: cfg.BatchSize, Intent: intent}
	s.usage = &Usage{DB: deps.DB, Logger: deps.Logger.With("reconciler", "usage"), Clock: deps.Clock,
		Interval: cfg.UsageInterval, Batch: cfg.BatchSize}
	s.liveness = &Liveness{DB: deps.DB, Logger: deps.Logger.With("reconciler", "liveness"), Clock: deps.Clock,
		Timeout: cfg.LivenessTimeout, Interval: cfg.LivenessInterval, Batch: cfg.BatchSize}
	for _, name := range []string{LeaseExpiry, LeaseUsage, LeaseLiveness} {
		s.leases = append(s.leases, &lease.Lease{DB: deps.DB, Name: name, Holder: cfg.Holder, TTL: cfg.LeaseTTL,
			Clock: deps.Clock, Logger: deps.Logger})
	}
	s.commandExpiry = &CommandExpiry{DB: deps.DB, Logger: deps.Logger.With("reconciler", "command-expiry"), Clock: deps.Clock,
		Interval: cfg.ExpiryInterval, Batch: cfg.BatchSize}
	s.commandLease = &lease.Lease{DB: deps.DB, Name: LeaseCommandExpiry, Holder: cfg.Holder, TTL: cfg.LeaseTTL,
		Clock: deps.Clock, Logger: deps.Logger}
	return s, nil
}

// Acceptance returns the acceptance reconciler (for tests and tools that
// drive a pass by hand).
func (s *Server) Acceptance() *Acceptance { return s.acceptance }

// Expiry returns the expiry reconciler (for tests and tools).
func (s *Server) Expiry() *Expiry { return s.expiry }

// Usage returns the usage sink (for tests and tools).
func (s *Server) Usage() *Usage { return s.usage }

// CommandExpiry returns the command expiry reconciler (for tests and
// tools).
func (s *Server) CommandExpiry() *CommandExpiry { return s.commandExpiry }

// Liveness returns the liveness sweeper (for tests and tools).
func (s *Server) Liveness() *Liveness { return s.liveness }

// LeaseHeld reports whether this replica holds the acceptance lease.
func (s *Server) LeaseHeld() bool { return s.lease.Held() }

// HealthHandler answers GET /healthz: 200 when the database answers a ping
// and NATS is connected, 503 otherwise.
func (s *Server) HealthHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/healthz", service.HealthHandler(
		func(ctx context.Context) error { return s.db.Pool.Ping(ctx) },
		func(context.Context) error {
			if !s.nc.IsConnected() {
				return errors.New("nats not connected")
			}
			return nil
		},
	))
	return mux
}

// Run runs the health server, the outbox relay and, while this replica holds
// their leases, the acceptance, expiry, usage and liveness reconcilers, until ctx ends; then it stops them,
// releases the lease and returns nil. It returns an error when the health
// listener cannot be opened or a loop fails.
func (s *Server) Run(ctx context.Context) error {
	var ln net.Listener
	if !s.cfg.NoHealthServer {
		ln = s.cfg.Listener
		if ln == nil {
			var err error
			ln, err = net.Listen("tcp", s.cfg.Listen)
			if err != nil {
				return fmt.Errorf("controllers: listen %s: %w", s.cfg.Listen, err)
			}
		}
	}
	s.log.Info("controllers starting", "holder", s.cfg.Holder)
	g, gctx := errgroup.WithContext(ctx)
	if ln != nil {
		g.Go(func() error {
			if err := service.Serve(gctx, s.log, service.NewServer("", s.HealthHandler()), ln); err != nil {
				return fmt.Errorf("controllers: health server: %w", err)
			}
			return nil
		})
	}
	g.Go(func() error {
		relay := &outbox.Relay{DB: s.db, NC: s.nc, Logger: s.log.With("reconciler", "outbox"), Clock: s.clk}
		if err := relay.Run(gctx); err != nil {
			return fmt.Errorf("controllers: outbox relay: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		if err := s.lease.Run(gctx, s.acceptance.Run); err != nil {
			return fmt.Errorf("controllers: acceptance: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		if err := s.leases[0].Run(gctx, s.expiry.Run); err != nil {
			return fmt.Errorf("controllers: expiry: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		if err := s.leases[1].Run(gctx, s.usage.Run); err != nil {
			return fmt.Errorf("controllers: usage: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		if err := s.leases[2].Run(gctx, s.liveness.Run); err != nil {
			return fmt.Errorf("controllers: liveness: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		if err := s.commandLease.Run(gctx, s.commandExpiry.Run); err != nil {
			return fmt.Errorf("controllers: command expiry: %w", err)
		}
		return nil
	})
	err := g.Wait()
	s.log.Info("controllers stopped")
	return err
}
