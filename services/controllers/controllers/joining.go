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

// LeaseJoining is the lease of the reconciler of stale joins.
const LeaseJoining = LeasePrefix + "joining"

// Defaults of the reconciler of stale joins.
const (
	// DefaultJoiningTimeout is how long a node may stay joining without
	// ever opening a session.
	DefaultJoiningTimeout = time.Hour
	// DefaultJoiningInterval is how often it looks.
	DefaultJoiningInterval = time.Minute
)

// Joining deletes the nodes that joined more than Timeout ago and never
// opened a session (store.ExpireJoiningNodes): a machine that never came,
// or the phantom of a replayed Join; each gives its join token its use back.
// A machine that comes later must join again.
type Joining struct {
	DB     *store.DB
	Logger *slog.Logger
	Clock  clock.Clock
	// Timeout is DefaultJoiningTimeout if zero; Interval
	// DefaultJoiningInterval; Batch DefaultBatchSize.
	Timeout, Interval time.Duration
	Batch             int
}

// Name returns "joining" (service.Runner); its lease is LeaseJoining.
func (j *Joining) Name() string { return "joining" }

// Run reconciles every Interval until ctx ends.
func (j *Joining) Run(ctx context.Context) error {
	return every(ctx, clockOf(j.Clock, j.DB), positive(j.Interval, DefaultJoiningInterval), j.Logger, "joining", j.Reconcile)
}

// Reconcile deletes every stale join, Batch per transaction, and returns
// how many it deleted.
func (j *Joining) Reconcile(ctx context.Context) (int, error) {
	total := 0
	for {
		var gone []string
		err := j.DB.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			gone, err = store.ExpireJoiningNodes(ctx, tx, clockOf(j.Clock, j.DB).Now(),
				positive(j.Timeout, DefaultJoiningTimeout), positive(j.Batch, DefaultBatchSize))
			return err
		})
		if err != nil {
			return total, err
		}
		total += len(gone)
		for _, id := range gone {
			logger(j.Logger).Info("stale join removed: the node never opened a session", telemetry.KeyNodeID, id)
		}
		if len(gone) < positive(j.Batch, DefaultBatchSize) {
			return total, nil
		}
	}
}
