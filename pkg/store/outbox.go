package store

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// NATS subjects written through the outbox.
const (
	// SubjectPokeGatewayPrefix + gateway id carries a Poke for the sessions
	// that gateway holds.
	SubjectPokeGatewayPrefix = "bc.poke.gw."
	// SubjectPokeControllers wakes the reconcilers (a node joined, a
	// command finished).
	SubjectPokeControllers = "bc.poke.controllers"
	// SubjectAPITokenRevoked carries an APITokenRevoked: an API token was
	// revoked (RevokeAPIToken), and API servers drop it from their token
	// caches (iam.Authenticator.Invalidate).
	SubjectAPITokenRevoked = "bc.iam.token.revoked"
	// OutboxChannel is the LISTEN/NOTIFY channel signalled when a
	// transaction that wrote outbox rows commits (signalOutbox).
	OutboxChannel = "bc_outbox"
	// SubjectOutboxWritten (no payload) wakes the outbox relays instead of a
	// NOTIFY on OutboxChannel where the writer has NATS (DB.SignalOutboxVia).
	SubjectOutboxWritten = "bc.outbox.written"
)

// Poke is the payload of a gateway poke: the nodes with new work.
type Poke struct {
	NodeIDs []string `json:"nodeIds"`
}

// APITokenRevoked is the payload of SubjectAPITokenRevoked, as JSON.
type APITokenRevoked struct {
	// TokenID is the revoked token's id ("tok_…").
	TokenID string `json:"tokenId"`
}

// Enqueue writes one outbox message in q's transaction and signals the relay,
// which receives the signal only if and when the transaction commits (see
// signalOutbox).
func Enqueue(ctx context.Context, q DBTX, now time.Time, subject string, payload []byte) error {
	if payload == nil {
		payload = []byte{}
	}
	_, err := q.Exec(ctx, `INSERT INTO outbox (subject, payload, created_at) VALUES ($1, $2, $3)`, subject, payload, now)
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", subject, err)
	}
	return signalOutbox(ctx, q)
}

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

// autoCommit is DB.AutoCommit: the pool, each statement its own
// transaction.
type autoCommit struct {
	*pgxpool.Pool
	db *DB
}

// AutoCommit returns a pool of db as a DBTX on which every statement is a
// transaction of its own, for a store function whose work is one statement
// (QueueCommands) or one pgx.Batch (ClaimSessionDeliveries): the outbox rows
// it writes are signalled to the relay as soon as it returns, as InTx
// signals them after its commit. Functions of several statements belong in
// InTx.
//
// Its connections run prepared statements with generic plans
// (plan_cache_mode = force_generic_plan): the batched statements of the hot
// paths (a command queued, delivered, finished) join arrays of a few to a
// few hundred rows through several CTEs, and Postgres, which otherwise
// re-plans such a statement for every execution when its generic plan looks
// costlier, spent more time planning them (~1 ms each) than running them.
// Their plans do not depend on the parameters' values (primary-key and
// node-id lookups). So do the events watch's reads (ScanEvents: an id
// range, its filters tested row by row). Queries whose best plan does — optional filters such as
// "$1 = ” OR tenant_id = $1" — stay on DB.Pool.
func (db *DB) AutoCommit() DBTX {
	if db.generic != nil {
		return autoCommit{Pool: db.generic, db: db}
	}
	return autoCommit{Pool: db.Pool, db: db}
}

// outboxTx is the transaction DB.InTx hands to its function: signalOutbox
// records that it wrote outbox rows.
type outboxTx struct {
	pgx.Tx
	wrote bool
}

// notifySQL notifies OutboxChannel in a transaction of its own that commits
// without waiting for its WAL flush, so the NOTIFY lock is held only briefly;
// a notification lost in a crash only delays the relay until its next poll.
const notifySQL = "BEGIN; SET LOCAL synchronous_commit = off; SELECT pg_notify('" + OutboxChannel + "', ''); COMMIT"

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
// notifySQL), so on a busy command path, where every batch writes outbox
// rows, it was a second transaction per batch. When send fails, the NOTIFY
// is sent as before. Call it before db is used; nil restores NOTIFY alone.
func (db *DB) SignalOutboxVia(send func() error) { db.outboxSignal = send }

// AutoCommitStat returns the statistics of the pool behind AutoCommit (the
// same as Pool.Stat() in a DB not made by Open).
func (db *DB) AutoCommitStat() *pgxpool.Stat {
	if db.generic != nil {
		return db.generic.Stat()
	}
	return db.Pool.Stat()
}

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
		_, _ = pool.Exec(ctx, notifySQL)
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

// PokeNodes enqueues one poke per gateway that holds a session of any of
// nodeIDs; nodes without a session get none (they read their work on Hello).
func PokeNodes(ctx context.Context, q DBTX, now time.Time, nodeIDs ...string) error {
	if len(nodeIDs) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, `SELECT gateway_id, array_agg(id ORDER BY id) FROM nodes
		WHERE id = ANY($1) AND gateway_id IS NOT NULL GROUP BY gateway_id`, nodeIDs)
	if err != nil {
		return fmt.Errorf("find gateways to poke: %w", err)
	}
	type target struct {
		gw    string
		nodes []string
	}
	var targets []target
	for rows.Next() {
		var t target
		if err := rows.Scan(&t.gw, &t.nodes); err != nil {
			rows.Close()
			return err
		}
		targets = append(targets, t)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, t := range targets {
		payload, err := json.Marshal(Poke{NodeIDs: t.nodes})
		if err != nil {
			return err
		}
		if err := Enqueue(ctx, q, now, SubjectPokeGatewayPrefix+t.gw, payload); err != nil {
			return err
		}
	}
	return nil
}

// OutboxMessage is an outbox row: a message not yet published.
type OutboxMessage struct {
	ID      int64
	Subject string
	Payload []byte
}

// TakeOutbox deletes up to limit outbox rows with ids above after, oldest
// (lowest id) first, skipping rows another transaction holds (another
// relay's batch), and returns them ordered by id; none is an empty slice and
// no error. It is one statement. Call it in a transaction and commit only
// once the messages are published: rolling back (a failed publish) puts them
// back for the next pass, so a message is published at least once. limit
// must be positive; after 0 reads from the oldest row.
//
// Why after: the rows the relay deleted stay in the primary key's index
// until a vacuum, and a scan from the oldest id reads every page of them
// (hundreds per call on a busy command path) before the first live row.
// The relay passes an id a little below the last it took (see
// outbox.Relay), and 0 when it polls.
func TakeOutbox(ctx context.Context, q DBTX, after int64, limit int) ([]OutboxMessage, error) {
	rows, err := q.Query(ctx, `DELETE FROM outbox WHERE id IN (
			SELECT id FROM outbox WHERE id > $2 ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
		RETURNING id, subject, payload`, limit, after)
	if err != nil {
		return nil, fmt.Errorf("take outbox: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[OutboxMessage])
	if err != nil {
		return nil, fmt.Errorf("take outbox: %w", err)
	}
	// RETURNING follows no ORDER BY.
	slices.SortFunc(out, func(a, b OutboxMessage) int { return cmp.Compare(a.ID, b.ID) })
	return out, nil
}
