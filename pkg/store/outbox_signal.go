package store

// Waking the outbox relays after a commit that wrote outbox rows: a mark on
// the transaction of DB.InTx, then a NOTIFY (or a NATS message) sent after
// the commit, coalesced so that a busy writer does not queue behind the NOTIFY
// lock.

import (
	"context"
	"slices"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// signalOutbox makes sure the relay hears of the outbox rows q's transaction
// wrote once it commits. In a transaction of DB.InTx it only marks the
// transaction, and InTx signals after the commit through the DB's notifier;
// otherwise it issues NOTIFY in q's transaction.
//
// Why not NOTIFY in every transaction: PostgreSQL serialises the commits of
// all transactions that issued NOTIFY behind one lock held through the commit
// record's WAL flush, so under load every outbox-writing transaction (each
// Reserve, placement batch and activation) queued behind the others' fsync.
func signalOutbox(ctx context.Context, q DBTX) error {
	switch t := q.(type) {
	case *outboxTx:
		t.wrote = true
		return nil
	case autoCommit:
		// The statement that wrote the rows has returned, so it committed.
		t.db.signalOutbox()
		return nil
	}
	_, err := q.Exec(ctx, `SELECT pg_notify($1, '')`, OutboxChannel)
	return err
}

// outboxTx is the transaction DB.InTx hands to its function: signalOutbox
// records that it wrote outbox rows, pokeAfterCommit the pokes to publish
// directly once it commits, hintEvents the events' hints.
type outboxTx struct {
	pgx.Tx
	wrote bool
	pokes []directPoke
}

// directPoke is a poke an outbox row carries that the writer also publishes
// itself after the commit (DB.PokeVia), or an event's hint (no row).
type directPoke struct {
	subject string
	payload []byte
	// outboxID is the row's id, which the message names
	// (OutboxIDHeader); 0 when the writer did not read it, or for a hint.
	outboxID int64
}

// pokeAfterCommit makes sure that the poke (subject, payload) q's
// transaction enqueued in outbox row outboxID (0: its id was not read) is
// also published directly once it commits, where
// the DB has a direct poke (DB.PokeVia): in a transaction of DB.InTx it
// records the poke (a scheduler poke once) and InTx publishes after the
// commit; in AutoCommit the statement has committed, and it publishes now.
// In any other transaction it does nothing: the relay publishes the row.
func pokeAfterCommit(q DBTX, subject string, payload []byte, outboxID int64) {
	p := directPoke{subject: subject, payload: payload, outboxID: outboxID}
	switch t := q.(type) {
	case *outboxTx:
		if subject == SubjectPokeScheduler && slices.ContainsFunc(t.pokes, func(p directPoke) bool { return p.subject == subject }) {
			return
		}
		t.pokes = append(t.pokes, p)
	case autoCommit:
		t.db.publishPokes([]directPoke{p})
	}
}

// hintEvents makes sure that the events watches hear, once q's transaction
// commits, that it wrote events: subjects are their hints
// (eventHintSubject), published with no payload through the DB's direct
// publish (DB.PokeVia), each once per transaction. A hint is the only
// message an event sends (the watch reads the events table: it only wakes
// it, and a lost one delays it until its poll), so it costs no row: in a
// transaction of DB.InTx it is recorded and InTx publishes it after the
// commit; in AutoCommit the statement has committed, and it is published
// now. In any other transaction, or without a direct publish, none is sent.
func hintEvents(q DBTX, subjects []string) {
	switch t := q.(type) {
	case *outboxTx:
		for _, s := range subjects {
			if !slices.ContainsFunc(t.pokes, func(p directPoke) bool { return p.subject == s }) {
				t.pokes = append(t.pokes, directPoke{subject: s})
			}
		}
	case autoCommit:
		pokes := make([]directPoke, len(subjects))
		for i, s := range subjects {
			pokes[i] = directPoke{subject: s}
		}
		t.db.publishPokes(pokes)
	}
}

// PokeVia makes db publish, by calling publish (a NATS publish, say) right
// after each commit of DB.InTx (or statement of AutoCommit) that enqueued
// them, the scheduler's poke (SubjectPokeScheduler, once per transaction)
// and the gateways' pokes of PokeNodes (a node's spec changed: a placement,
// a release, an adoption), so that the scheduler and the gateways are woken
// by the commit and not only once the outbox relay has taken the rows,
// published them and committed their delete. The outbox rows stay: the
// relay publishes them too (at least once, whatever happens to the direct
// publish), and their readers take the copy as one more idempotent hint (the
// scheduler coalesces it into at most one more pass). A gateway poke names
// its outbox row (outboxID, which publish sets in the message's
// OutboxIDHeader, as the relay does: bus.PublishWithID), so that a gateway
// acts on the first copy and drops the other; outboxID is 0 for a message
// that names no row. A failed publish is left to the relay. It also
// publishes the hints of the events a commit wrote (hintEvents), which have
// no outbox row: a failed or missing one leaves the watches to their poll.
// Call it before db is used; nil stops the direct pokes and the events'
// hints.
func (db *DB) PokeVia(publish func(subject string, payload []byte, outboxID int64) error) {
	db.poke = publish
}

// publishPokes publishes pokes directly, when db has a direct poke
// (PokeVia); a failure only leaves a poke to the relay.
func (db *DB) publishPokes(pokes []directPoke) {
	if db.poke == nil {
		return
	}
	for _, p := range pokes {
		_ = db.poke(p.subject, p.payload, p.outboxID)
	}
}

// OutboxNotifySQL is the outbox notifier's statement: it notifies
// OutboxChannel in a transaction of its own that commits
// without waiting for its WAL flush, so the NOTIFY lock is held only briefly;
// a notification lost in a crash only delays the relay until its next poll.
const OutboxNotifySQL = "BEGIN; SET LOCAL synchronous_commit = off; SELECT pg_notify('" + OutboxChannel + "', ''); COMMIT"

// outboxNotifier coalesces the post-commit signals of DB.InTx into NOTIFYs:
// at most one runs at a time, and signals that arrive meanwhile cause one
// more. Its zero value is ready; close stops it.
type outboxNotifier struct {
	mu     sync.Mutex
	wake   chan struct{}
	cancel context.CancelFunc
	done   chan struct{}
	closed bool
}

// SignalOutboxVia makes db wake the outbox relays by calling send (a NATS
// publish on SubjectOutboxWritten, say) after each commit that wrote outbox
// rows, instead of a NOTIFY: that NOTIFY is a transaction of its own (see
// OutboxNotifySQL), so on a busy command path, where every batch writes outbox
// rows, it was a second transaction per batch. When send fails, the NOTIFY
// is sent as before. Call it before db is used; nil restores NOTIFY alone.
func (db *DB) SignalOutboxVia(send func() error) { db.outboxSignal = send }

// signalOutbox wakes the relays after a commit that wrote outbox rows.
func (db *DB) signalOutbox() {
	if db.outboxSignal != nil && db.outboxSignal() == nil {
		return
	}
	db.notifier.signal(db.Pool)
}

// signal asks for a NOTIFY on OutboxChannel soon, starting the notifier's
// goroutine on first use. It never blocks.
func (n *outboxNotifier) signal(pool *pgxpool.Pool) {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return
	}
	if n.wake == nil {
		ctx, cancel := context.WithCancel(context.Background())
		n.wake, n.cancel, n.done = make(chan struct{}, 1), cancel, make(chan struct{})
		go n.run(ctx, pool)
	}
	n.mu.Unlock()
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

func (n *outboxNotifier) run(ctx context.Context, pool *pgxpool.Pool) {
	defer close(n.done)
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.wake:
		}
		// A failure only delays the relay until its next poll.
		_, _ = pool.Exec(ctx, OutboxNotifySQL)
	}
}

// close stops the goroutine and waits for it.
func (n *outboxNotifier) close() {
	n.mu.Lock()
	n.closed = true
	cancel, done := n.cancel, n.done
	n.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}
