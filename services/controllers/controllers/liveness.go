package controllers

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// LeaseLiveness is the lease name of the liveness sweeper.
const LeaseLiveness = LeasePrefix + "liveness"

// Defaults of the liveness sweeper.
const (
	// DefaultLivenessTimeout is how long a node may go unheard before it is
	// marked unreachable.
	DefaultLivenessTimeout = 30 * time.Second
	// DefaultLivenessInterval is how often the sweeper looks.
	DefaultLivenessInterval = time.Second
)

// Liveness is the liveness sweeper (docs/architecture.md, "Session"): every Interval it marks
// unreachable (nodes.reachable = false, a node.unreachable event) the
// reachable nodes not heard from for Timeout whose session, if any, no
// present gateway holds (store.SweepUnreachable), Batch per transaction.
// It never marks a node within 20 s of any gateway hearing from it (I4): see
// pkg/store/liveness.go for why, with batched last_seen writes and several
// gateways. A node becomes reachable again through its gateway (a new
// session or its next message), not here. Marking a node unreachable ends
// none of its reservations (I5). Overlapping passes (a lease takeover) do no
// harm: nodes are claimed with SKIP LOCKED and marked only while reachable.
type Liveness struct {
	// DB is the database; required.
	DB *store.DB
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
	// Timeout is how long a node may go unheard; DefaultLivenessTimeout if
	// zero, at least store.MinLivenessTimeout (20 s).
	Timeout time.Duration
	// Interval is how often it looks; DefaultLivenessInterval if zero.
	Interval time.Duration
	// Batch is how many nodes one transaction marks; DefaultBatchSize if
	// zero.
	Batch int
	// Metrics makes its counters (bc.liveness.sweeps, bc.liveness.unreachable);
	// nil is the global MeterProvider.
	Metrics *telemetry.Metrics

	m livenessMetrics
}

// Name returns "liveness" (service.Runner); its lease is LeasePrefix + "liveness".
func (l *Liveness) Name() string { return "liveness" }

// Run sweeps every Interval until ctx ends; it returns nil then. A failed
// pass is logged and retried at the next tick.
func (l *Liveness) Run(ctx context.Context) error {
	return every(ctx, l.clock(), positive(l.Interval, DefaultLivenessInterval), l.Logger, "liveness", l.Reconcile)
}

func (l *Liveness) clock() clock.Clock { return clockOf(l.Clock, l.DB) }

// Reconcile marks unreachable every node due now, Batch per transaction,
// and returns their ids. Errors: a Timeout below store.MinLivenessTimeout.
func (l *Liveness) Reconcile(ctx context.Context) ([]string, error) {
	timeout := positive(l.Timeout, DefaultLivenessTimeout)
	if timeout < store.MinLivenessTimeout {
		return nil, fmt.Errorf("liveness: timeout %s is below %s (I4)", timeout, store.MinLivenessTimeout)
	}
	batch := positive(l.Batch, DefaultBatchSize)
	m := l.m.init(l.Metrics)
	var all []string
	defer func() {
		m.sweeps.Add(ctx, 1)
		if len(all) > 0 {
			m.unreachable.Add(ctx, int64(len(all)))
		}
	}()
	for {
		var ids []string
		err := l.DB.InTx(ctx, func(tx pgx.Tx) error {
			now := l.clock().Now().UTC().Truncate(time.Microsecond)
			var err error
			ids, err = store.SweepUnreachable(ctx, tx, now, timeout, batch)
			return err
		})
		if err != nil {
			return all, err
		}
		for _, id := range ids {
			logger(l.Logger).Info("node unreachable", telemetry.KeyNodeID, id, "timeout", timeout.String())
		}
		all = append(all, ids...)
		if len(ids) < batch {
			return all, nil
		}
	}
}
