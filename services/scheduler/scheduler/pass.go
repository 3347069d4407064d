package scheduler

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// PassResult counts what one Schedule pass did.
type PassResult struct {
	// Placed is how many reservations turned binding.
	Placed int
	// Failed is how many failed because no node can ever hold them.
	Failed int
	// Waiting is how many stay pending for lack of room.
	Waiting int
	// Conflicts is how many batches or placements lost to another writer
	// (the bookings' exclusion constraint, or a node that changed since the
	// view read it) and were re-planned.
	Conflicts int
	// Again is true when the pass left due work behind (a full read, or a
	// placement lost on its last attempt): run another pass at once.
	Again bool
	// Timings is where the pass spent its time.
	Timings PassTimings
}

// PassTimings splits a pass's wall time by phase.
type PassTimings struct {
	// Pending reads the pending reservations; Capacity brings the pools'
	// views up to date (what changed of their nodes and bookings); Plan
	// plans in memory; Write writes failures and placements (the
	// transactions, commit included).
	Pending, Capacity, Plan, Write time.Duration
}

// attempts is how many times a pool is planned within one pass; the last
// attempt writes one placement per transaction.
const attempts = 3

func (s *Server) now() time.Time { return s.clk.Now().UTC().Truncate(time.Microsecond) }

// Schedule runs one placement pass: it reads the due pending reservations
// (up to MaxPending) and, pool by pool, plans them on the pool's free
// capacity (its view, brought up to date) and writes the plan (see planPool
// and the package comment). Passes of one Server run one at a time. It can
// run in any number of replicas at once: the database keeps bookings from
// overlapping and placements off nodes that changed since the plan. It returns the first error that stopped a pool; the
// other pools are still scheduled.
func (s *Server) Schedule(ctx context.Context) (PassResult, error) {
	s.passMu.Lock()
	defer s.passMu.Unlock()
	var res PassResult
	began := s.clk.Now()
	pending, err := store.PendingReservations(ctx, s.db.Pool, s.now(), s.cfg.MaxPending)
	if err != nil {
		return res, err
	}
	res.Timings.Pending = s.clk.Now().Sub(began)
	res.Again = len(pending) >= s.cfg.MaxPending
	var firstErr error
	for start := 0; start < len(pending); {
		end := start
		for end < len(pending) && pending[end].PoolID == pending[start].PoolID {
			end++
		}
		if err := s.schedulePool(ctx, pending[start].PoolID, pending[start:end], &res); err != nil && firstErr == nil {
			firstErr = fmt.Errorf("pool %s: %w", pending[start].PoolID, err)
		}
		start = end
	}
	if res.Placed+res.Failed+res.Conflicts > 0 {
		s.log.Info("scheduling pass", "placed", res.Placed, "failed", res.Failed, "waiting", res.Waiting,
			"conflicts", res.Conflicts, "duration", s.clk.Now().Sub(began), "pending_read", res.Timings.Pending,
			"capacity_read", res.Timings.Capacity, "plan", res.Timings.Plan, "write", res.Timings.Write)
	}
	return res, firstErr
}

// schedulePool plans and writes one pool's queue, re-planning on fresh data
// after a conflict.
func (s *Server) schedulePool(ctx context.Context, poolID string, queue []store.PendingReservation, res *PassResult) error {
	for attempt := 1; ; attempt++ {
		t0 := s.clk.Now()
		now := s.now()
		nodes, booked, err := s.capacity(ctx, poolID, now)
		if err != nil {
			return err
		}
		t1 := s.clk.Now()
		plan := planPool(queue, nodes, booked, now, s.cfg.StarvationBound)
		t2 := s.clk.Now()
		res.Timings.Capacity += t1.Sub(t0)
		res.Timings.Plan += t2.Sub(t1)
		if plan.Head != "" {
			s.log.Debug("pool keeps a node for a reservation that waited past the starvation bound",
				telemetry.KeyPoolID, poolID, telemetry.KeyReservationID, plan.Head,
				telemetry.KeyNodeID, plan.ShadowNode, "from", plan.ShadowAt)
		}
		failed, err := s.fail(ctx, plan.Failures)
		res.Timings.Write += s.clk.Now().Sub(t2)
		if err != nil {
			return err
		}
		res.Failed += failed
		perReservation := attempt == attempts
		t3 := s.clk.Now()
		placed, placedIDs, conflict, err := s.place(ctx, poolID, plan.Placements, perReservation)
		res.Timings.Write += s.clk.Now().Sub(t3)
		res.Placed += placed
		s.placed.Add(int64(placed))
		s.placements.Add(ctx, int64(placed))
		if err != nil {
			return err
		}
		if !conflict || perReservation {
			res.Waiting += plan.Waiting
			if conflict {
				res.Conflicts++
				res.Again = true
			}
			t4 := s.clk.Now()
			err := s.explain(ctx, plan.Reasons)
			res.Timings.Write += s.clk.Now().Sub(t4)
			return err
		}
		res.Conflicts++
		// Re-plan what is still pending on fresh data.
		queue = remaining(queue, placedIDs, plan.Failures)
	}
}

// remaining is queue without the placed and failed reservations.
func remaining(queue []store.PendingReservation, placed map[string]bool, failed []store.ReservationFailure) []store.PendingReservation {
	gone := make(map[string]bool, len(failed))
	for _, f := range failed {
		gone[f.ID] = true
	}
	out := queue[:0:0]
	for _, r := range queue {
		if !placed[r.ID] && !gone[r.ID] {
			out = append(out, r)
		}
	}
	return out
}

// explain writes the reasons of reservations that stay pending, in one
// statement (only those that changed: see store.SetPendingReasons).
func (s *Server) explain(ctx context.Context, rs []store.PendingReason) error {
	if len(rs) == 0 {
		return nil
	}
	_, err := store.SetPendingReasons(ctx, s.db.Pool, s.now(), rs)
	return err
}

// fail writes the failures in one transaction.
func (s *Server) fail(ctx context.Context, fs []store.ReservationFailure) (int, error) {
	if len(fs) == 0 {
		return 0, nil
	}
	var failed []string
	err := s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		failed, err = store.FailReservations(ctx, tx, s.now(), fs)
		return err
	})
	if err != nil {
		return 0, err
	}
	reasons := make(map[string]string, len(fs))
	for _, f := range fs {
		reasons[f.ID] = f.Reason
	}
	for _, id := range failed {
		s.log.Info("reservation failed", telemetry.KeyReservationID, id, "reason", reasons[id])
	}
	return len(failed), nil
}

// place writes placements Batch per transaction (one per transaction when
// perReservation), each onto the nodes at the generations of the pool's
// view, and applies what each committed to the view. It stops at the first
// batch that conflicts (conflict true: a booking overlapped a committed one,
// and the view is dropped; or the batch skipped nodes that changed since the
// view read them, and those are read again) unless perReservation, where a
// conflicting placement is skipped. It returns how many it placed and which.
func (s *Server) place(ctx context.Context, poolID string, ps []store.Placement, perReservation bool) (int, map[string]bool, bool, error) {
	size := s.cfg.Batch
	if perReservation {
		size = 1
	}
	placed := map[string]bool{}
	conflict := false
	for start := 0; start < len(ps); start += size {
		chunk := ps[start:min(start+size, len(ps))]
		gens := s.generations(poolID, chunk)
		var done store.PlaceResult
		err := s.db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			done, err = store.PlaceReservationsAt(ctx, tx, s.intent, s.now(), chunk, gens)
			return err
		})
		if store.IsConstraint(err, store.BookingsNoOverlap) {
			// The view missed a booking: read the pool again whole.
			s.dropView(poolID)
			conflict = true
			if perReservation {
				continue
			}
			return len(placed), placed, true, nil
		}
		if err != nil {
			// Whether it committed is unknown.
			s.dropView(poolID)
			return len(placed), placed, conflict, err
		}
		s.applyPlaced(poolID, chunk, done)
		for _, id := range done.Placed {
			placed[id] = true
		}
		if len(done.Skipped) > 0 {
			conflict = true
			if !perReservation {
				return len(placed), placed, true, nil
			}
		}
	}
	return len(placed), placed, conflict, nil
}
