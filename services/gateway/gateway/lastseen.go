package gateway

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// lastSeenBatcher collects, per node, when the gateway last heard from it and
// the greatest generation its heartbeats reported, and writes them all in one
// statement every interval (or as soon as maxBatch nodes are pending). A
// failed flush keeps its entries for the next one, so staleness grows only
// while the database is unavailable. The lag of nodes.last_seen behind the
// last message is therefore at most interval plus one flush's duration.
//
// Every flush, even an empty one, renews the gateway's presence
// (store.RecordGatewayPresence, store.GatewayPresenceTTL) in the same
// transaction: the liveness sweeper leaves alone the nodes whose session a
// present gateway holds, however late their batch. A flush that has not
// committed within store.GatewayFlushTimeout is abandoned as failed (so a
// database that hangs counts as one that fails), and when a flush fails
// and none that started in the last store.GatewayFenceAfter succeeded,
// fence is called (it aborts every session), so that the gateway stops
// hearing from nodes it can no longer vouch for long before its presence
// expires (I4; see pkg/store/liveness.go).
type lastSeenBatcher struct {
	db        *store.DB
	clk       clock.Clock
	log       *slog.Logger
	gatewayID string
	interval  time.Duration
	maxBatch  int
	fence     func()
	// lastOK is when the last successful flush started, which is no later
	// than the presence it wrote; run's goroutine only.
	lastOK time.Time

	mu      sync.Mutex
	pending map[string]store.SessionLastSeen
	full    chan struct{} // signalled when pending reaches maxBatch
}

func newLastSeenBatcher(db *store.DB, clk clock.Clock, log *slog.Logger, gatewayID string, interval time.Duration, maxBatch int,
	fence func()) *lastSeenBatcher {
	return &lastSeenBatcher{
		db: db, clk: clk, log: log, gatewayID: gatewayID, interval: interval, maxBatch: maxBatch, fence: fence,
		pending: make(map[string]store.SessionLastSeen),
		full:    make(chan struct{}, 1),
	}
}

// record notes that the gateway heard from st's node at now.
func (b *lastSeenBatcher) record(st *session, now time.Time) {
	ls := store.SessionLastSeen{
		NodeID:             st.nodeID,
		SessionID:          st.sessionID,
		At:                 now.UTC().Truncate(time.Microsecond),
		ObservedGeneration: st.reported.Load(),
	}
	b.mu.Lock()
	b.merge(ls)
	n := len(b.pending)
	b.mu.Unlock()
	if n >= b.maxBatch {
		select {
		case b.full <- struct{}{}:
		default:
		}
	}
}

// merge adds ls to pending, keeping the latest time and session and the
// greatest generation. b.mu must be held.
func (b *lastSeenBatcher) merge(ls store.SessionLastSeen) {
	old, ok := b.pending[ls.NodeID]
	if ok {
		if old.At.After(ls.At) {
			ls.At, ls.SessionID = old.At, old.SessionID
		}
		ls.ObservedGeneration = max(ls.ObservedGeneration, old.ObservedGeneration)
	}
	b.pending[ls.NodeID] = ls
}

// flush writes what is pending in one statement and renews the gateway's
// presence, in one transaction. On failure the entries go back to pending
// (merged with newer ones) and the error is returned.
func (b *lastSeenBatcher) flush(ctx context.Context) error {
	b.mu.Lock()
	batch := make([]store.SessionLastSeen, 0, len(b.pending))
	for _, ls := range b.pending {
		batch = append(batch, ls)
	}
	clear(b.pending)
	b.mu.Unlock()
	err := b.db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := store.RecordSessionLastSeen(ctx, tx, batch); err != nil {
			return err
		}
		// The presence's start is taken after the batch was, so it
		// never vouches for a hearing the batch does not hold.
		return store.RecordGatewayPresence(ctx, tx, b.db.Now(), b.gatewayID, store.GatewayPresenceTTL)
	})
	if err != nil {
		b.mu.Lock()
		for _, ls := range batch {
			b.merge(ls)
		}
		b.mu.Unlock()
	}
	return err
}

// run flushes every interval, and early when the batch is full, until ctx
// ends; then it flushes once more.
func (b *lastSeenBatcher) run(ctx context.Context) {
	t := b.clk.NewTicker(b.interval)
	defer t.Stop()
	b.lastOK = b.clk.Now()
	b.tick(ctx)
	for {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			if err := b.flush(fctx); err != nil {
				b.log.Warn("final last_seen flush failed", telemetry.KeyError, err)
			}
			cancel()
			return
		case <-t.C():
		case <-b.full:
		}
		b.tick(ctx)
	}
}

// tick flushes once, giving up after store.GatewayFlushTimeout, and fences
// the gateway when no flush that started in the last
// store.GatewayFenceAfter succeeded.
func (b *lastSeenBatcher) tick(ctx context.Context) {
	started := b.clk.Now()
	fctx, cancel := context.WithTimeout(ctx, store.GatewayFlushTimeout)
	err := b.flush(fctx)
	cancel()
	if err == nil {
		b.lastOK = started
		return
	}
	if ctx.Err() != nil {
		return
	}
	b.log.Warn("last_seen flush failed", telemetry.KeyError, err)
	if since := clock.Since(b.clk, b.lastOK); since > store.GatewayFenceAfter {
		b.log.Error("no last_seen flush succeeded for too long: closing every session", "since", since.String())
		b.fence()
	}
}
