package controllers

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// LeaseCommandExpiry is the lease name of the command expiry reconciler.
const LeaseCommandExpiry = LeasePrefix + "command-expiry"

// DefaultCommandExpiryInterval is how often CommandExpiry looks for
// commands past their deadline.
const DefaultCommandExpiryInterval = time.Second

// CommandExpiry ends user commands at their deadline: every
// Interval it moves the queued, delivered and running user commands whose
// deadline has passed to expired, Batch per transaction, each with its
// command.expired event (store.ExpireDueCommands). Acceptance commands are
// the acceptance reconciler's. A daemon's later report of an expired
// command changes nothing (states only move forward, and a terminal state
// is final), and a report after the deadline that comes before this
// reconciler records the command expired too
// (store.ApplySessionCommandUpdates), so the outcome does not depend on
// which ran first. It claims rows with SKIP LOCKED, so an overlap of two replicas
// during a lease takeover does no harm.
type CommandExpiry struct {
	// DB is the database; required.
	DB *store.DB
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
	// Interval is how often it looks; DefaultCommandExpiryInterval if zero.
	Interval time.Duration
	// Batch is how many commands one transaction expires; DefaultBatchSize
	// if zero.
	Batch int
	// Metrics makes the commands' counter and histogram
	// (bc.commands.finished, bc.commands.duration); nil is the global
	// MeterProvider.
	Metrics *telemetry.Metrics

	m commandMetrics
}

// Name returns "command-expiry" (service.Runner); its lease is LeasePrefix + "command-expiry".
func (e *CommandExpiry) Name() string { return "command-expiry" }

// Run expires due commands every Interval until ctx ends; it returns nil
// then. A failed pass is logged and retried at the next tick.
func (e *CommandExpiry) Run(ctx context.Context) error {
	return every(ctx, clockOf(e.Clock, e.DB), positive(e.Interval, DefaultCommandExpiryInterval), e.Logger,
		"command expiry", e.Reconcile)
}

// Reconcile expires every user command past its deadline now and returns
// how many it expired.
func (e *CommandExpiry) Reconcile(ctx context.Context) (int, error) {
	clk := clockOf(e.Clock, e.DB)
	batch := positive(e.Batch, DefaultBatchSize)
	total := 0
	for {
		var expired []store.Command
		err := e.DB.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			expired, err = store.ExpireDueCommands(ctx, tx, clk.Now().UTC().Truncate(time.Microsecond), batch)
			return err
		})
		if err != nil {
			return total, err
		}
		total += len(expired)
		m := e.m.init(e.Metrics)
		now := clk.Now()
		for _, c := range expired {
			m.ended(ctx, c, c.State, now)
			logger(e.Logger).Info("command expired", telemetry.KeyCommandID, c.ID, telemetry.KeyNodeID, c.NodeID,
				"kind", c.Kind, "previous_deliveries", c.Deliveries)
		}
		if len(expired) < batch {
			return total, nil
		}
	}
}
