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

// Lease names of the reservation reconcilers.
const (
	LeaseExpiry = LeasePrefix + "expiry"
	LeaseUsage  = LeasePrefix + "usage"
)

// Defaults of the reservation reconcilers.
const (
	DefaultExpiryInterval = time.Second
	DefaultUsageInterval  = time.Minute
)

// Expiry ends reservations at their end time (docs/architecture.md, "Reservations"): every Interval it
// claims (FOR UPDATE SKIP LOCKED) reservations not yet ended whose end_at ≤
// now, Batch per transaction, and ends each with store.EndReservation(state
// expired): bookings end, the node's spec drops the allocation (signed),
// the gateway and the scheduler are poked and a reservation.expired event is
// written. A reservation still pending at its end was never placed: it fails
// instead (store.FailNeverPlaced: reason "never placed: no node had N free
// GPUs before its end time", event reservation.failed). Nothing else ends a
// reservation: a node's connectivity never does (I5).
type Expiry struct {
	// DB is the database; required.
	DB *store.DB
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
	// Interval is how often it looks; DefaultExpiryInterval if zero.
	Interval time.Duration
	// Batch is how many reservations one transaction ends; DefaultBatchSize
	// if zero.
	Batch int
	// Intent signs the NodeSpecs it changes; nil leaves them unsigned.
	Intent *store.IntentSigner
}

// Name returns "expiry" (service.Runner); its lease is LeasePrefix + "expiry".
func (e *Expiry) Name() string { return "expiry" }

// Run expires due reservations every Interval until ctx ends; it returns
// nil then. A failed pass is logged and retried at the next tick.
func (e *Expiry) Run(ctx context.Context) error {
	return every(ctx, clockOf(e.Clock, e.DB), positive(e.Interval, DefaultExpiryInterval), e.Logger, "expiry", e.Reconcile)
}

// Reconcile ends every reservation due now (expired, or failed when never
// placed), Batch per transaction, and returns how many it ended.
func (e *Expiry) Reconcile(ctx context.Context) (int, error) {
	clk := clockOf(e.Clock, e.DB)
	batch := positive(e.Batch, DefaultBatchSize)
	total := 0
	for {
		var (
			ended    []store.EndedReservation
			endedIDs []string
			failed   []store.ReservationFailure
			ids      []string
		)
		err := e.DB.InTx(ctx, func(tx pgx.Tx) error {
			ended, endedIDs, failed, ids = nil, nil, nil, nil
			now := clk.Now().UTC().Truncate(time.Microsecond)
			var err error
			if ids, err = store.ClaimDueReservations(ctx, tx, now, batch); err != nil {
				return err
			}
			if failed, err = store.FailNeverPlaced(ctx, tx, now, ids); err != nil {
				return err
			}
			gone := make(map[string]bool, len(failed))
			for _, f := range failed {
				gone[f.ID] = true
			}
			for _, id := range ids {
				if gone[id] {
					continue
				}
				r, err := store.EndReservation(ctx, tx, e.Intent, store.AllTenants, now, id, store.ReservationExpired)
				if err != nil {
					return err
				}
				ended, endedIDs = append(ended, r), append(endedIDs, id)
			}
			return nil
		})
		if err != nil {
			return total, err
		}
		for _, f := range failed {
			total++
			logger(e.Logger).Info("reservation failed", telemetry.KeyReservationID, f.ID,
				telemetry.KeyTenantID, f.TenantID, "reason", f.Reason)
		}
		for i, r := range ended {
			if r.Changed {
				total++
				logger(e.Logger).Info("reservation expired", telemetry.KeyReservationID, endedIDs[i],
					telemetry.KeyTenantID, r.TenantID, telemetry.KeyNodeID, r.NodeID)
			}
		}
		if len(ids) < batch {
			return total, nil
		}
	}
}

// Usage is the usage sink (I8): every Interval it writes the final usage
// windows (GPU-seconds per reservation and UTC hour) of every placed
// reservation, Batch reservations per statement (see pkg/store usage.go for
// what a window counts and when it is final). A window is written once:
// replays and racing replicas count nothing twice.
type Usage struct {
	// DB is the database; required.
	DB *store.DB
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
	// Interval is how often it writes; DefaultUsageInterval if zero.
	Interval time.Duration
	// Batch is how many reservations one statement covers;
	// DefaultBatchSize if zero.
	Batch int
}

// Name returns "usage" (service.Runner); its lease is LeasePrefix + "usage".
func (u *Usage) Name() string { return "usage" }

// Run writes usage windows every Interval until ctx ends; it returns nil
// then.
func (u *Usage) Run(ctx context.Context) error {
	return every(ctx, clockOf(u.Clock, u.DB), positive(u.Interval, DefaultUsageInterval), u.Logger, "usage", u.Reconcile)
}

// Reconcile writes every final usage window not yet written and returns how
// many it wrote.
func (u *Usage) Reconcile(ctx context.Context) (int64, error) {
	clk := clockOf(u.Clock, u.DB)
	batch := positive(u.Batch, DefaultBatchSize)
	now := clk.Now().UTC().Truncate(time.Microsecond)
	var total int64
	after := ""
	for {
		ids, err := store.UsageCandidates(ctx, u.DB.Pool, after, batch)
		if err != nil {
			return total, err
		}
		n, err := store.WriteUsageWindows(ctx, u.DB.Pool, now, ids)
		total += n
		if err != nil {
			return total, err
		}
		if len(ids) < batch {
			break
		}
		after = ids[len(ids)-1]
	}
	if total > 0 {
		logger(u.Logger).Info("usage windows written", "windows", total)
	}
	return total, nil
}

// every runs pass at once and then every interval on clk until ctx ends,
// and returns nil then: the Run of the reconcilers that look every Interval
// (Expiry, CommandExpiry, Usage, Liveness). A failed pass is logged ("NAME
// pass failed") and retried at the next tick.
func every[T any](ctx context.Context, clk clock.Clock, interval time.Duration, log *slog.Logger, name string,
	pass func(context.Context) (T, error)) error {
	tick := clk.NewTicker(interval)
	defer tick.Stop()
	for {
		if _, err := pass(ctx); err != nil && ctx.Err() == nil {
			logger(log).Warn(name+" pass failed", telemetry.KeyError, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C():
		}
	}
}

// clockOf is clk, or db's clock when clk is nil.
func clockOf(clk clock.Clock, db *store.DB) clock.Clock {
	if clk != nil {
		return clk
	}
	return db.Clock
}

func positive[T int | time.Duration](v, def T) T {
	if v > 0 {
		return v
	}
	return def
}

func logger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return telemetry.Discard()
}
