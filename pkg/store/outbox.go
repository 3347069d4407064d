package store

// The outbox (docs/architecture.md, "Services", invariant I6): messages
// written in the transaction that makes the change they describe, taken and
// published by the relay after the commit. outbox_signal.go wakes the relay.

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// NATS subjects written through the outbox.
const (
	// SubjectPokeGatewayPrefix + gateway id carries a Poke for the sessions
	// that gateway holds.
	SubjectPokeGatewayPrefix = "bc.poke.gw."
	// SubjectPokeControllers wakes the reconcilers (a node joined, a
	// command finished).
	SubjectPokeControllers = "bc.poke.controllers"
	// SubjectPokeScheduler wakes the scheduler: capacity appeared (a node
	// was adopted, freed or uncordoned) or a reservation is waiting.
	SubjectPokeScheduler = "bc.poke.scheduler"
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
	// OutboxIDHeader is the NATS header that names the outbox row a message
	// is a copy of, by its id (decimal): the relay sets it on every row it
	// publishes, and a writer that also publishes a row's message itself
	// right after the commit (QueueCommands' gateway pokes, QueueResult.PokeID)
	// sets it there too, so that a reader may act on the first copy and drop
	// the other.
	OutboxIDHeader = "Bc-Outbox-Id"
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

// Enqueue writes one outbox message in q's transaction, with the trace
// context of ctx's span (telemetry.Traceparent, which the relay publishes
// in the message's traceparent header), and signals the relay, which
// receives the signal only if and when the transaction commits (see
// signalOutbox). A SubjectPokeScheduler message is also published by the
// writer itself right after the commit where the DB has a direct poke
// (DB.PokeVia; see pokeAfterCommit).
func Enqueue(ctx context.Context, q DBTX, now time.Time, subject string, payload []byte) error {
	if payload == nil {
		payload = []byte{}
	}
	_, err := q.Exec(ctx, `INSERT INTO outbox (subject, payload, created_at, traceparent) VALUES ($1, $2, $3, $4)`,
		subject, payload, now, telemetry.Traceparent(ctx))
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", subject, err)
	}
	if subject == SubjectPokeScheduler {
		pokeAfterCommit(q, subject, nil, 0)
	}
	return signalOutbox(ctx, q)
}

// PokeNodes enqueues one poke per gateway that holds a session of any of
// nodeIDs (payload Poke, its node ids in order); nodes without a session get
// none (they read their work on Hello). It is one statement. Where the DB
// has a direct poke (DB.PokeVia), each is also published right after the
// commit, naming its outbox row, so that a gateway acts on one of the two
// copies.
func PokeNodes(ctx context.Context, q DBTX, now time.Time, nodeIDs ...string) error {
	if len(nodeIDs) == 0 {
		return nil
	}
	// The pokes and their ids are returned from the CTE, not from the
	// INSERT (RETURNING subject would need SELECT on it, which most
	// writers' roles lack): p takes each row's id from the sequence, once
	// (a CTE read twice is evaluated once).
	rows, err := q.Query(ctx, `WITH g AS (
			SELECT $2 || gateway_id AS subject,
				convert_to(jsonb_build_object('nodeIds', array_agg(id ORDER BY id))::text, 'UTF8') AS payload
			FROM nodes WHERE id = ANY($1) AND gateway_id IS NOT NULL GROUP BY gateway_id),
		p AS MATERIALIZED (SELECT nextval('outbox_id_seq') AS id, subject, payload FROM g),
		ins AS (INSERT INTO outbox (id, subject, payload, created_at, traceparent) SELECT id, subject, payload, $3, $4 FROM p)
		SELECT id, subject, payload FROM p`, nodeIDs, SubjectPokeGatewayPrefix, now, telemetry.Traceparent(ctx))
	if err != nil {
		return fmt.Errorf("poke gateways: %w", interpretError(err))
	}
	var pokes []directPoke
	for rows.Next() {
		var p directPoke
		if err := rows.Scan(&p.outboxID, &p.subject, &p.payload); err != nil {
			rows.Close()
			return fmt.Errorf("poke gateways: %w", err)
		}
		pokes = append(pokes, p)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("poke gateways: %w", interpretError(err))
	}
	if len(pokes) == 0 {
		return nil
	}
	for _, p := range pokes {
		pokeAfterCommit(q, p.subject, p.payload, p.outboxID)
	}
	return signalOutbox(ctx, q)
}

// OutboxMessage is an outbox row: a message not yet published.
type OutboxMessage struct {
	ID      int64
	Subject string
	Payload []byte
	// CreatedAt is when the row was written.
	CreatedAt time.Time
	// Traceparent is the W3C trace context of the request that wrote the
	// row, "" when none (telemetry.Traceparent).
	Traceparent string
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
		RETURNING id, subject, payload, created_at, traceparent`, limit, after)
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

// DeadLetterOutbox writes m, an outbox row that can never be published (a
// payload above the NATS server's max payload, a subject NATS refuses), to
// outbox_dead_letters with reason, a sentence saying why, and now as its
// dead_at. Call it in the transaction that took m (TakeOutbox), which then
// commits with the rows after m published and m out of the outbox.
func DeadLetterOutbox(ctx context.Context, q DBTX, now time.Time, m OutboxMessage, reason string) error {
	payload := m.Payload
	if payload == nil {
		payload = []byte{}
	}
	_, err := q.Exec(ctx, `INSERT INTO outbox_dead_letters (outbox_id, subject, payload, created_at, dead_at, reason)
		VALUES ($1, $2, $3, $4, $5, $6)`, m.ID, m.Subject, payload, m.CreatedAt, now, reason)
	if err != nil {
		return fmt.Errorf("dead-letter outbox row %d: %w", m.ID, err)
	}
	return nil
}
