package store

// Liveness: the liveness sweeper's query (SweepUnreachable) and gateway
// presence, which tells the sweeper whether the gateway holding a node's
// session is alive.
//
// Invariant I4 (no node marked unreachable within 20 s of any gateway
// hearing from it) rests on three rules, whatever the number of gateways and
// however their last_seen writes are batched:
//
//  1. A node whose live session (nodes.session_id) is held by a gateway with
//     an unexpired presence is never swept: its batch may be late, but that
//     gateway closes the session when it stops hearing from the node, and
//     CloseSession writes the session's last message time into last_seen in
//     the same statement that clears session_id.
//  2. A node is swept only when last_seen < now − timeout (timeout ≥ 20 s,
//     MinLivenessTimeout): every hearing that reached the database is at
//     least timeout old.
//  3. Hearings that never reached the database (a gateway leaves out those
//     that follow a written one of the same session closely, and its last
//     batch may never be written) are covered by its presence while it
//     holds the node's live session (rule 1), and otherwise bounded by its
//     presence's expiry: it renews its presence (expiry = write time +
//     GatewayPresenceTTL) in the transaction of every last_seen flush, every
//     flush interval F ≤ MaxGatewayFlushInterval; a flush not committed
//     within GatewayFlushTimeout fails (a hung database counts as a failing
//     one); and the gateway aborts all its sessions when a flush fails and
//     none that started in the last GatewayFenceAfter succeeded. A
//     successful flush starts before its presence write w, so the last
//     hearing is at most w + GatewayFenceAfter + F + GatewayFlushTimeout,
//     while the sweeper treats the gateway as dead only from w +
//     GatewayPresenceTTL on: the gap is at least 30 s − 5 s − 2 s − 1 s =
//     22 s ≥ 20 s. A gateway that restarts under the same id
//     (ResetGatewaySessions) raises its nodes' last_seen to its start time,
//     which is after any hearing of its previous run.
//
// Clocks of gateways and controllers are assumed to agree within a second
// (NTP); the 2 s of slack above absorbs that.

import (
	"context"
	"fmt"
	"time"
)

// Liveness bounds (see the package comment of this file for the
// arithmetic behind I4).
const (
	// MinLivenessTimeout is the smallest liveness timeout that keeps I4.
	MinLivenessTimeout = 20 * time.Second
	// GatewayPresenceTTL is how long a gateway counts as alive after a
	// successful last_seen flush.
	GatewayPresenceTTL = 30 * time.Second
	// GatewayFenceAfter is how long a gateway keeps its sessions without a
	// successful last_seen flush; then it aborts them all.
	GatewayFenceAfter = 5 * time.Second
	// GatewayFlushTimeout is how long a gateway's last_seen flush may take
	// before it is abandoned as failed.
	GatewayFlushTimeout = time.Second
	// MaxGatewayFlushInterval bounds a gateway's last_seen flush interval,
	// so that a healthy gateway flushes well within GatewayFenceAfter.
	MaxGatewayFlushInterval = 2 * time.Second
)

// gatewayPresencePrefix prefixes a gateway's presence row in leases:
// name "gateway.<gateway id>", holder the gateway id.
const gatewayPresencePrefix = "gateway."

// RecordGatewayPresence marks gateway gatewayID alive until now + ttl (a row
// "gateway.<id>" of leases). Call it in the transaction of the gateway's
// last_seen flush, so that presence proves the flush.
func RecordGatewayPresence(ctx context.Context, q DBTX, now time.Time, gatewayID string, ttl time.Duration) error {
	_, err := q.Exec(ctx, `INSERT INTO leases (name, holder, expires_at, acquired_at) VALUES ($1, $2, $3, $4)
		ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at`,
		gatewayPresencePrefix+gatewayID, gatewayID, now.Add(ttl), now)
	if err != nil {
		return fmt.Errorf("record presence of gateway %s: %w", gatewayID, interpretError(err))
	}
	return nil
}

// ResetGatewaySessions clears the sessions that gateway gatewayID held in a
// previous run (it holds none when it starts) and raises their nodes'
// last_seen to now, after any message that run may have heard but not
// flushed. It returns how many nodes it changed. It reads every node (no
// index on gateway_id: migration 000027 dropped it so that sessions open and
// close without index writes), once per gateway start.
func ResetGatewaySessions(ctx context.Context, q DBTX, now time.Time, gatewayID string) (int64, error) {
	tag, err := q.Exec(ctx, `UPDATE nodes SET gateway_id = NULL, session_id = NULL,
			last_seen = GREATEST(last_seen, $2), updated_at = $2
		WHERE gateway_id = $1`, gatewayID, now)
	if err != nil {
		return 0, fmt.Errorf("reset sessions of gateway %s: %w", gatewayID, interpretError(err))
	}
	return tag.RowsAffected(), nil
}

// SweepUnreachable marks unreachable at most limit reachable nodes not heard
// from for timeout (last_seen < now − timeout; a reachable node has a
// last_seen, set with reachable by OpenSessions) whose live session,
// if any, is held by no gateway with an unexpired presence, and writes a
// node.unreachable event for each. Nodes locked by another transaction are
// skipped. It returns the ids it marked. Their reservations and bookings
// are left alone (I5). Errors: timeout below MinLivenessTimeout.
func SweepUnreachable(ctx context.Context, q DBTX, now time.Time, timeout time.Duration, limit int) ([]string, error) {
	if timeout < MinLivenessTimeout {
		return nil, fmt.Errorf("sweep unreachable: timeout %s is below %s (I4)", timeout, MinLivenessTimeout)
	}
	cutoff := now.Add(-timeout)
	ids, err := queryIDs(ctx, q, "sweep unreachable", `WITH c AS (
			SELECT n.id FROM nodes n
			WHERE n.reachable AND n.last_seen < $2
				AND (n.session_id IS NULL OR n.gateway_id IS NULL OR NOT EXISTS (
					SELECT 1 FROM leases l WHERE l.name = $4 || n.gateway_id AND l.expires_at > $1))
			ORDER BY n.id LIMIT $3 FOR NO KEY UPDATE OF n SKIP LOCKED)
		UPDATE nodes n SET reachable = false, updated_at = $1 FROM c
		WHERE n.id = c.id AND n.reachable
		RETURNING n.id`, now, cutoff, limit, gatewayPresencePrefix)
	if err != nil {
		return nil, err
	}
	if err := writeEventsOfNodes(ctx, q, now, ids, func(id string) EventData {
		return NodeUnreachableData{NodeID: id, TimeoutSeconds: timeout.Seconds()}
	}); err != nil {
		return nil, err
	}
	return ids, nil
}
