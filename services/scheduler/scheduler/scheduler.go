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
// reads every due pending reservation, brings each pool's capacity view up
// to date (poolView: the pool's nodes and open bookings held in memory
// between passes, of which only the nodes whose capacity generation moved
// are read again), plans in memory and writes the placements Batch at a
// time, each batch one transaction (bookings, binding, the nodes' signed
// NodeSpecs, events: store.PlaceReservationsAt). The lease only keeps
// replicas from contending: safety comes from the database. A placement is
// written only onto a node still at the generation the plan saw (read under
// the node's lock; the others are skipped and read again), and a batch that
// overlaps a booking another writer committed fails on the bookings'
// exclusion constraint (I1) and rolls back whole, the pool's view is read
// again whole, and the pass re-plans; the last attempt places one
// reservation per transaction so that one conflict costs only itself.
//
// To change placement rules, change planPool (pure, unit tested); to add a
// resource kind, extend store.PoolCapacitySince (and the capacity
// generation's triggers, migration 000021) and planPool's notion of a free
// device.
package scheduler

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Name is the scheduler's name in logs, errors and `scheduler
// healthcheck`.
const Name = "scheduler"

// LeaseName is the lease the active scheduler holds.
const LeaseName = "scheduler"

// Config configures the scheduler. The binary reads it from the
// environment (pkg/config; docs/configuration.md lists the variables); New
// gives every zero field its default. With SignedIntent, every NodeSpec the
// scheduler writes is signed with PKIDir/command-signing.key (see
// store.IntentSigner).
type Config struct {
	service.Database
	service.NATS
	service.PKI
	service.Intent
	service.Leases
	// Probes: a standby replica, without the lease, is ready too.
	service.Probes `default:"HEALTH_LISTEN=:8083"`
	// Interval is how often a scheduling pass runs without a poke.
	Interval time.Duration `env:"SCHEDULE_INTERVAL,positive" default:"2s"`
	// StarvationBound is how long a pending reservation that does not fit
	// may be passed freely by newer reservations of its pool; past it, the
	// oldest such one keeps its shadow (the node and time at which it is
	// sure to start) and newer ones are placed only where they do not delay
	// it: EASY backfilling, see planPool.
	StarvationBound time.Duration `env:"STARVATION_BOUND,positive" default:"5m"`
	// Batch is how many placements one transaction writes.
	Batch int `default:"1000"`
	// MaxPending is how many pending reservations one pass reads; a full
	// read runs another pass at once.
	MaxPending int `default:"20000"`
}

// Deps are the scheduler's dependencies: DB and NC (the pokes that wake it)
// are required.
type Deps = service.Deps

// Server is one scheduler replica.
type Server struct {
	cfg    Config
	deps   Deps
	db     *store.DB
	nc     *nats.Conn
	log    *slog.Logger
	clk    clock.Clock
	lease  *lease.Lease
	intent *store.IntentSigner
	passes atomic.Int64
	placed atomic.Int64
	// passMu makes passes of this replica one at a time: they share views.
	passMu sync.Mutex
	// views are the pools' capacity as this replica holds it (poolView), by
	// pool id; passes (under passMu) read and write it.
	views map[string]*poolView
	// placements counts placed in bc.scheduler.placements.
	placements metric.Int64Counter
}

// meterName is the instrumentation scope of the scheduler's instruments.
const meterName = "github.com/better-compute/better-compute/services/scheduler"

// registerMetrics makes the scheduler's instruments (docs/metrics.md):
// bc.scheduler.placements, and bc.lease.held of its lease.
func (s *Server) registerMetrics() error {
	meter := s.deps.Meter(meterName)
	s.placements = telemetry.Int64Counter(meter, telemetry.ReservationsPlaced)
	held := telemetry.Int64Gauge(meter, telemetry.LeaseHeld)
	attrs := telemetry.Attrs(attribute.String(telemetry.LabelLease, s.lease.Name))
	_, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		v := int64(0)
		if s.lease.Held() {
			v = 1
		}
		o.ObserveInt64(held, v, attrs)
		return nil
	}, held)
	return err
}

// New checks cfg and deps and returns a Server; it starts nothing.
func New(cfg Config, deps Deps) (*Server, error) {
	deps, err := deps.Complete(Name, true)
	if err != nil {
		return nil, err
	}
	config.SetDefaults(&cfg)
	if cfg.Holder == "" {
		cfg.Holder = lease.DefaultHolder()
	}
	s := &Server{cfg: cfg, deps: deps, db: deps.DB, nc: deps.NC, log: deps.Logger, clk: deps.Clock,
		lease: cfg.Lease(LeaseName, deps), views: map[string]*poolView{}}
	if cfg.SignedIntent {
		if s.intent, err = store.LoadIntentSigner(cfg.PKIDir); err != nil {
			return nil, fmt.Errorf("scheduler: %w", err)
		}
	}
	if err := s.registerMetrics(); err != nil {
		return nil, fmt.Errorf("scheduler: metrics: %w", err)
	}
	return s, nil
}

// LeaseHeld reports whether this replica holds the scheduler lease.
func (s *Server) LeaseHeld() bool { return s.lease.Held() }

// Passes returns how many scheduling passes this replica has run.
func (s *Server) Passes() int64 { return s.passes.Load() }

// Placed returns how many reservations this replica has placed.
func (s *Server) Placed() int64 { return s.placed.Load() }

// Name returns Name (service.Runner).
func (s *Server) Name() string { return Name }

// Run runs, through the service lifecycle (service.Run), the probes server
// and, while this replica holds the lease, the scheduling loop, until ctx
// ends; then it releases the lease and returns nil. It returns an error
// when the probes listener cannot be opened or the loop fails.
func (s *Server) Run(ctx context.Context) error {
	s.log.Info("scheduler starting", "holder", s.cfg.Holder)
	return service.Run(ctx, service.Spec{Name: Name, Deps: s.deps, Servers: s.cfg.Servers(),
		Parts: []service.Runner{service.Leased(s.lease, service.Func("scheduling", s.loop))}})
}

// loop runs a pass on every poke and every Interval until ctx ends; a pass
// that left work behind (a full read, a conflict) is followed by another at
// once.
func (s *Server) loop(ctx context.Context) error {
	// A replica that (again) holds the lease starts from the database.
	s.passMu.Lock()
	clear(s.views)
	s.passMu.Unlock()
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
