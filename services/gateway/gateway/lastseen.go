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
// while the database is unavailable.
//
// A hearing less than every after the last one of its session that was
// written (the session's open, which wrote last_seen, or a hearing recorded
// since) is not recorded, unless it raised the generation the daemon
// reported above the one written: a burst of messages (a join's reports,
// a command's updates) writes a node's row once, not once per flush. With
// every half the heartbeat interval, every heartbeat of an idle session is
// still written. The lag of nodes.last_seen behind the last message is
// therefore at most every plus interval plus one flush's duration. No
// invariant rests on it: a node whose live session a present gateway holds
// is never swept, a session's close writes its last message's time, and a
// gateway's hearings end within store.GatewayFenceAfter of its last
// presence (store's liveness rules; I4).
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
	// every is the least time between two hearings of a session that are
	// written (record).
	every    time.Duration
	maxBatch int
	fence    func()
	// lastOK is when the last successful flush started, which is no later
	// than the presence it wrote; run's goroutine only.
	lastOK time.Time

	mu      sync.Mutex
	pending map[string]store.SessionLastSeen
	full    chan struct{} // signalled when pending reaches maxBatch
}

func newLastSeenBatcher(db *store.DB, clk clock.Clock, log *slog.Logger, gatewayID string, interval, every time.Duration,
	maxBatch int, fence func()) *lastSeenBatcher {
	return &lastSeenBatcher{
		db: db, clk: clk, log: log, gatewayID: gatewayID, interval: interval, every: every, maxBatch: maxBatch, fence: fence,
		pending: make(map[string]store.SessionLastSeen),
		full:    make(chan struct{}, 1),
	}
}

// record notes that the gateway heard from st's node at now, unless a
// hearing of st less than b.every before now was written and st reports no
// generation above the one written (see lastSeenBatcher). Only st's handler
// calls it.
func (b *lastSeenBatcher) record(st *session, now time.Time) {
	gen := st.reported.Load()
	if now.UnixNano()-st.seenWritten.Load() < int64(b.every) && gen <= st.genWritten.Load() {
		return
	}
	st.seenWritten.Store(now.UnixNano())
	raise(&st.genWritten, gen)
	ls := store.SessionLastSeen{
		NodeID:             st.nodeID,
		SessionID:          st.sessionID,
		At:                 now.UTC().Truncate(time.Microsecond),
		ObservedGeneration: gen,
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
