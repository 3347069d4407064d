// Package scheduler places pending reservations onto free devices
// (docs/architecture.md, "Reservations"): each reservation whole on one node, best fit, FIFO per pool with a
// bounded wait for large requests and EASY backfilling around the oldest
// one past it (see planPool for the exact rules), on adopted, reachable,
// uncordoned, non-revoked nodes. A pass writes why each reservation it
// leaves pending waits (reservations.reason, only when it changes).
//
// The scheduler holds the LeaseName lease (one active replica, released on
// shutdown) and runs a pass on every poke on store.SubjectPokeScheduler
// (pokes during a pass coalesce into one more) and every Interval. A pass
// reads every due pending reservation and each pool's free capacity once,
// plans in memory and writes the placements Batch at a time, each batch one
// transaction (bookings, binding, the nodes' signed NodeSpecs, events:
// store.PlaceReservations). The lease only keeps replicas from contending:
// safety comes from the bookings' exclusion constraint (I1). A batch that
// overlaps a booking another replica committed rolls back whole, and the
// pass re-plans on fresh data; the last attempt places one reservation per
// transaction so that one conflict costs only itself.
//
// To change placement rules, change planPool (pure, unit tested); to add a
// resource kind, extend store.PoolCapacity and planPool's notion of a free
// device.
package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Defaults of Config.
const (
	DefaultListen   = ":8083"
	DefaultInterval = 2 * time.Second
	DefaultLeaseTTL = lease.DefaultTTL
	// DefaultStarvationBound is how long a reservation that does not fit may
	// be passed freely by newer ones before its pool keeps a node for it.
	DefaultStarvationBound = 5 * time.Minute
	DefaultBatch           = 1000
	DefaultMaxPending      = 20000
	DefaultPKIDir          = "/var/lib/better-compute/pki"
)

// LeaseName is the lease the active scheduler holds.
const LeaseName = "scheduler"

// Config configures the scheduler. Zero fields take the defaults above.
type Config struct {
	// Listen is the address of the HTTP server answering GET /healthz (env
	// BC_LISTEN, DefaultListen); unused when Listener is set.
	Listen string
	// Listener, when set, is where the health server accepts connections;
	// Run closes it.
	Listener net.Listener
	// NoHealthServer runs no health server (for `better-compute dev` and
	// tests).
	NoHealthServer bool
	// Interval is how often a pass runs without a poke (env
	// BC_SCHEDULE_INTERVAL, 2 s).
	Interval time.Duration
	// LeaseTTL is the TTL of the scheduler lease (env BC_LEASE_TTL, 15 s):
	// a dead replica's work resumes elsewhere within about this long.
	LeaseTTL time.Duration
	// Holder names this replica in the leases table (env BC_LEASE_HOLDER,
	// lease.DefaultHolder()).
	Holder string
	// StarvationBound is how long a pending reservation that does not fit
	// may be passed freely by newer reservations of its pool; past it, the
	// oldest such one keeps its shadow (the node and time at which it is
	// sure to start) and newer ones are placed only where they do not delay
	// it: EASY backfilling, see planPool (env BC_STARVATION_BOUND, 5 min).
	StarvationBound time.Duration
	// Batch is how many placements one transaction writes (1000).
	Batch int
	// MaxPending is how many pending reservations one pass reads (20,000);
	// a full read runs another pass at once.
	MaxPending int
	// SignedIntent signs every NodeSpec the scheduler writes with the
	// command-signing root (env BC_SIGNED_INTENT; see store.IntentSigner),
	// read from PKIDir.
	SignedIntent bool
	// PKIDir holds command-signing.key (env BC_PKI_DIR, DefaultPKIDir); read
	// only with SignedIntent.
	PKIDir string
}

// Deps are the scheduler's dependencies.
type Deps struct {
	// DB is the database; required.
	DB *store.DB
	// NC carries the pokes that wake the scheduler; required.
	NC *nats.Conn
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
}

// Server is one scheduler replica.
type Server struct {
	cfg    Config
	db     *store.DB
	nc     *nats.Conn
	log    *slog.Logger
	clk    clock.Clock
	lease  *lease.Lease
	intent *store.IntentSigner
	passes atomic.Int64
	placed atomic.Int64
}

// New checks cfg and deps and returns a Server; it starts nothing.
func New(cfg Config, deps Deps) (*Server, error) {
	if deps.DB == nil {
		return nil, errors.New("scheduler: Deps.DB is required")
	}
	if deps.NC == nil {
		return nil, errors.New("scheduler: Deps.NC is required")
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
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.Holder == "" {
		cfg.Holder = lease.DefaultHolder()
	}
	if cfg.StarvationBound <= 0 {
		cfg.StarvationBound = DefaultStarvationBound
	}
	if cfg.Batch <= 0 {
		cfg.Batch = DefaultBatch
	}
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	if cfg.PKIDir == "" {
		cfg.PKIDir = DefaultPKIDir
	}
	s := &Server{cfg: cfg, db: deps.DB, nc: deps.NC, log: deps.Logger, clk: deps.Clock}
	if cfg.SignedIntent {
		var err error
		if s.intent, err = store.LoadIntentSigner(cfg.PKIDir); err != nil {
			return nil, fmt.Errorf("scheduler: %w", err)
		}
	}
	s.lease = &lease.Lease{DB: deps.DB, Name: LeaseName, Holder: cfg.Holder, TTL: cfg.LeaseTTL,
		Clock: deps.Clock, Logger: deps.Logger}
	return s, nil
}

// LeaseHeld reports whether this replica holds the scheduler lease.
func (s *Server) LeaseHeld() bool { return s.lease.Held() }

// Passes returns how many scheduling passes this replica has run.
func (s *Server) Passes() int64 { return s.passes.Load() }

// Placed returns how many reservations this replica has placed.
func (s *Server) Placed() int64 { return s.placed.Load() }

// HealthHandler answers GET /healthz: 200 when the database answers a ping
// and NATS is connected, 503 otherwise. A standby replica (without the
// lease) is healthy.
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

// Run serves /healthz and, while this replica holds the lease, runs the
// scheduling loop, until ctx ends; then it releases the lease and returns
// nil. It returns an error when the health listener cannot be opened or the
// loop fails.
func (s *Server) Run(ctx context.Context) error {
	var ln net.Listener
	if !s.cfg.NoHealthServer {
		ln = s.cfg.Listener
		if ln == nil {
			var err error
			ln, err = net.Listen("tcp", s.cfg.Listen)
			if err != nil {
				return fmt.Errorf("scheduler: listen %s: %w", s.cfg.Listen, err)
			}
		}
	}
	s.log.Info("scheduler starting", "holder", s.cfg.Holder)
	g, gctx := errgroup.WithContext(ctx)
	if ln != nil {
		g.Go(func() error {
			if err := service.Serve(gctx, s.log, service.NewServer("", s.HealthHandler()), ln); err != nil {
				return fmt.Errorf("scheduler: health server: %w", err)
			}
			return nil
		})
	}
	g.Go(func() error {
		if err := s.lease.Run(gctx, s.loop); err != nil {
			return fmt.Errorf("scheduler: %w", err)
		}
		return nil
	})
	err := g.Wait()
	s.log.Info("scheduler stopped")
	return err
}

// loop runs a pass on every poke and every Interval until ctx ends; a pass
// that left work behind (a full read, a conflict) is followed by another at
// once.
func (s *Server) loop(ctx context.Context) error {
	wake := make(chan struct{}, 1)
	sub, err := s.nc.Subscribe(store.SubjectPokeScheduler, func(*nats.Msg) {
		select {
		case wake <- struct{}{}:
		default:
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", store.SubjectPokeScheduler, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	tick := s.clk.NewTicker(s.cfg.Interval)
	defer tick.Stop()
	for {
		s.passes.Add(1)
		res, err := s.Schedule(ctx)
		if err != nil && ctx.Err() == nil {
			s.log.Warn("scheduling pass failed", telemetry.KeyError, err)
		}
		if err == nil && res.Again {
			if ctx.Err() != nil {
				return nil
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-tick.C():
		}
	}
}
