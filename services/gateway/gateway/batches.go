package gateway

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/batch"
	"github.com/better-compute/better-compute/pkg/store"
)

// The sessions' database writes go through batchers (pkg/batch): each
// session still waits for its own answer, but the sessions whose writes
// arrive while the batcher's workers are busy share one round trip and one
// commit. Workers bound the database connections each kind of write takes
// from the pool that every service shares.
const (
	// claimWorkers is how many delivery claims (store.ClaimSessionDeliveries)
	// may run at once.
	claimWorkers = 1
	// updateWorkers is how many batches of command updates
	// (store.ApplySessionCommandUpdates) may run at once.
	updateWorkers = 1
	// observedWorkers is how many batches of reported generations
	// (store.RecordSessionObservedGenerations) may run at once.
	observedWorkers = 2
	// activationWorkers is how many batches of AllocationBound reports
	// (store.ActivateReservations) may run at once.
	activationWorkers = 1
	// openWorkers is how many batches of session opens
	// (store.OpenSessions) may run at once.
	openWorkers = 2
	// maxBatch is the most writes of one kind in one statement.
	maxBatch = 256
	// retries is how many times a batch outside a transaction of DB.InTx
	// runs again after a deadlock or serialization failure
	// (store.IsRetryable), which fails every session in it otherwise.
	retries = 3
)

// batchers are the gateway's batched writes; startBatchers starts them and
// close stops them.
type batchers struct {
	claims   *batch.Batcher[store.ClaimRequest, store.SessionDelivery]
	updates  *batch.Batcher[store.SessionCommandUpdate, store.SessionCommandUpdated]
	observed *batch.Batcher[store.ObservedGeneration, struct{}]
	// activations turn reservations active (allocationBound).
	activations *batch.Batcher[store.AllocationBound, store.Activation]
	opens       *batch.Batcher[store.OpenSessionRequest, store.OpenSessionResult]
}

func (s *Server) startBatchers() *batchers {
	return &batchers{
		claims:   batch.New(s.flushClaims, batch.Options{Workers: claimWorkers, MaxBatch: maxBatch}),
		updates:  batch.New(s.flushUpdates, batch.Options{Workers: updateWorkers, MaxBatch: maxBatch}),
		observed: batch.New(s.flushObserved, batch.Options{Workers: observedWorkers, MaxBatch: maxBatch}),
		activations: batch.New(s.flushActivations,
			batch.Options{Workers: activationWorkers, MaxBatch: maxBatch}),
		opens: batch.New(s.flushOpens, batch.Options{Workers: openWorkers, MaxBatch: maxBatch}),
	}
}

func (b *batchers) close() {
	b.claims.Close()
	b.updates.Close()
	b.observed.Close()
	b.activations.Close()
	b.opens.Close()
}

// retry runs fn, which writes in one implicit transaction, again while it
// fails with a deadlock or serialization failure, up to retries times.
func retry(fn func() error) error {
	err := fn()
	for i := 0; i < retries && store.IsRetryable(err); i++ {
		err = fn()
	}
	return err
}

// flushClaims claims the deliveries of sessions in one round trip.
func (s *Server) flushClaims(ctx context.Context, reqs []store.ClaimRequest) ([]store.SessionDelivery, error) {
	var out []store.SessionDelivery
	err := retry(func() error {
		var err error
		out, err = store.ClaimSessionDeliveries(ctx, s.db.AutoCommit(), s.db.Now(), reqs)
		return err
	})
	return out, err
}

// flushUpdates records daemons' command updates, all at the time of the
// flush, in one statement (with the events and pokes of the terminal ones).
func (s *Server) flushUpdates(ctx context.Context, us []store.SessionCommandUpdate) ([]store.SessionCommandUpdated, error) {
	now := s.db.Now()
	for i := range us {
		us[i].Now = now
	}
	var out []store.SessionCommandUpdated
	err := retry(func() error {
		var err error
		out, err = store.ApplySessionCommandUpdates(ctx, s.db.AutoCommit(), us)
		return err
	})
	return out, err
}

// flushObserved records the generations daemons reported in one statement.
func (s *Server) flushObserved(ctx context.Context, gens []store.ObservedGeneration) ([]struct{}, error) {
	err := retry(func() error {
		_, err := store.RecordSessionObservedGenerations(ctx, s.db.AutoCommit(), s.db.Now(), gens)
		return err
	})
	if err != nil {
		return nil, err
	}
	return make([]struct{}, len(gens)), nil
}

// flushActivations records daemons' AllocationBound reports, all at the
// time of the flush, in one statement (with the events of the reservations
// it activates).
func (s *Server) flushActivations(ctx context.Context, reports []store.AllocationBound) ([]store.Activation, error) {
	var out []store.Activation
	err := retry(func() error {
		var err error
		out, err = store.ActivateReservations(ctx, s.db.AutoCommit(), s.db.Now(), reports)
		return err
	})
	return out, err
}

// flushOpens checks the certificates of Hellos and opens their sessions,
// with the node.reachable events, in one statement (store.OpenSessions) on
// its own, run again after a deadlock or serialization failure; Hellos of
// one node in one batch (each superseding the one before) take a statement
// each, in one transaction, which DB.InTx runs again.
func (s *Server) flushOpens(ctx context.Context, reqs []store.OpenSessionRequest) ([]store.OpenSessionResult, error) {
	var out []store.OpenSessionResult
	if distinctNodes(reqs) {
		err := retry(func() error {
			var err error
			out, err = store.OpenSessions(ctx, s.db.AutoCommit(), reqs)
			return err
		})
		return out, err
	}
	err := s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		out, err = store.OpenSessions(ctx, tx, reqs)
		return err
	})
	return out, err
}

// distinctNodes reports whether reqs name each node once.
func distinctNodes(reqs []store.OpenSessionRequest) bool {
	seen := make(map[string]struct{}, len(reqs))
	for _, r := range reqs {
		if _, ok := seen[r.NodeID]; ok {
			return false
		}
		seen[r.NodeID] = struct{}{}
	}
	return true
}
