package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"
)

// NATS subjects written through the outbox.
const (
	// SubjectPokeGatewayPrefix + gateway id carries a Poke for the sessions
	// that gateway holds.
	SubjectPokeGatewayPrefix = "bc.poke.gw."
	// SubjectPokeControllers wakes the reconcilers (a node joined, a
	// command finished).
	SubjectPokeControllers = "bc.poke.controllers"
	// OutboxChannel is the LISTEN/NOTIFY channel signalled, at commit, by
	// every transaction that writes an outbox row.
	OutboxChannel = "bc_outbox"
)

// Poke is the payload of a gateway poke: the nodes with new work.
type Poke struct {
	NodeIDs []string `json:"nodeIds"`
}

// Enqueue writes one outbox message in q's transaction and signals the relay,
// which receives the signal only if and when the transaction commits.
func Enqueue(ctx context.Context, q DBTX, now time.Time, subject string, payload []byte) error {
	if payload == nil {
		payload = []byte{}
	}
	_, err := q.Exec(ctx, `INSERT INTO outbox (subject, payload, created_at) VALUES ($1, $2, $3)`, subject, payload, now)
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", subject, err)
	}
	_, err = q.Exec(ctx, `SELECT pg_notify($1, '')`, OutboxChannel)
	return err
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

// OutboxMessage is an unpublished outbox row.
type OutboxMessage struct {
	ID      int64
	Subject string
	Payload []byte
}

// ClaimOutbox locks up to limit unpublished messages, oldest first, skipping
// rows another relay holds. Call it in a transaction and MarkPublished the
// ones sent before commit.
func ClaimOutbox(ctx context.Context, q DBTX, limit int) ([]OutboxMessage, error) {
	rows, err := q.Query(ctx, `SELECT id, subject, payload FROM outbox WHERE published_at IS NULL
		ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []OutboxMessage
	for rows.Next() {
		var m OutboxMessage
		if err := rows.Scan(&m.ID, &m.Subject, &m.Payload); err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, rows.Err()
}

// MarkPublished stamps messages as published at now.
func MarkPublished(ctx context.Context, q DBTX, now time.Time, ids []int64) error {
	_, err := q.Exec(ctx, `UPDATE outbox SET published_at = $2 WHERE id = ANY($1)`, ids, now)
	return err
}

// PruneOutbox deletes messages published before cutoff and returns how many.
func PruneOutbox(ctx context.Context, q DBTX, cutoff time.Time) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM outbox WHERE published_at < $1`, cutoff)
	return tag.RowsAffected(), err
}
