package store

// Queries of node trust: the certificates issued to nodes and presented by
// their sessions, revocation (the API's RevokeNode), and the refusals daemons
// report when signedIntent is on.

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// NewNodeCert is a certificate JoinService issued to a node, to record in
// node_certs.
type NewNodeCert struct {
	// Serial is the certificate's serial in lower-case hex (pki.SerialHex).
	Serial string
	NodeID string
	// PublicKeySHA256 is the SHA-256 of the certificate's
	// SubjectPublicKeyInfo (pki.PublicKeySHA256).
	PublicKeySHA256 []byte
	NotBefore       time.Time
	NotAfter        time.Time
	CreatedAt       time.Time
}

// CreateNodeCert records an issued node certificate. Errors: ErrConflict
// when the serial exists.
func CreateNodeCert(ctx context.Context, q DBTX, c NewNodeCert) error {
	_, err := q.Exec(ctx, `INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, created_at)
		VALUES ($1, $2, $3, $4, $5, $6)`, c.Serial, c.NodeID, c.PublicKeySHA256, c.NotBefore, c.NotAfter, c.CreatedAt)
	if err != nil {
		return queryErr("create node cert", err)
	}
	return nil
}

// SessionCert is what a session needs of a row of node_certs.
type SessionCert struct {
	Serial   string
	NodeID   string
	NotAfter time.Time
	// RevokedAt is when the certificate, or its whole node (nodes.revoked_at),
	// was revoked; nil when neither is.
	RevokedAt *time.Time
}

const sessionCertQuery = `SELECT c.serial, c.node_id, c.not_after, COALESCE(c.revoked_at, n.revoked_at)
	FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = $1`

// GetSessionCert returns the node certificate with serial (lower-case hex, see
// pki.SerialHex), or ErrNotFound.
func GetSessionCert(ctx context.Context, q DBTX, serial string) (SessionCert, error) {
	return scanSessionCert(q.QueryRow(ctx, sessionCertQuery, serial))
}

// LockSessionCert is GetSessionCert that also locks the certificate's node
// (FOR NO KEY UPDATE) until the transaction ends, so that a concurrent
// RevokeNode either commits first (and RevokedAt shows it) or waits: a
// certificate issued in the same transaction never outlives a revocation.
// Two renewals of one node wait for each other too, so that what one reads
// of the node's certificates (LastNodeCertCreatedAt) holds until it
// commits. Writes that only reference the node (FOR KEY SHARE: commands)
// do not wait.
func LockSessionCert(ctx context.Context, q DBTX, serial string) (SessionCert, error) {
	return scanSessionCert(q.QueryRow(ctx, sessionCertQuery+` FOR NO KEY UPDATE OF n`, serial))
}

// LastNodeCertCreatedAt returns when the newest certificate of node nodeID
// was recorded (node_certs.created_at: at join or at a renewal), or the zero
// time when the node has none. JoinService's renewal rate limit counts from
// it.
func LastNodeCertCreatedAt(ctx context.Context, q DBTX, nodeID string) (time.Time, error) {
	var at *time.Time
	if err := q.QueryRow(ctx, `SELECT max(created_at) FROM node_certs WHERE node_id = $1`, nodeID).Scan(&at); err != nil {
		return time.Time{}, queryErr(fmt.Sprintf("certificates of node %s", nodeID), err)
	}
	if at == nil {
		return time.Time{}, nil
	}
	return *at, nil
}

func scanSessionCert(row pgx.Row) (SessionCert, error) {
	var c SessionCert
	if err := row.Scan(&c.Serial, &c.NodeID, &c.NotAfter, &c.RevokedAt); err != nil {
		return SessionCert{}, interpretError(err)
	}
	return c, nil
}

// RevokedNode says what RevokeNode did.
type RevokedNode struct {
	// RevokedAt is when the node was revoked: now, or the earlier time of a
	// previous revocation.
	RevokedAt time.Time
	// Reason is the node's revoke reason: this call's, or the earlier one of
	// a previous revocation (which a later call never replaces).
	Reason string
	// CertificatesRevoked is how many of the node's certificates this call
	// revoked (0 when they all were already).
	CertificatesRevoked int
	// Newly is false when the node was already revoked.
	Newly bool
	// CommandsFailed are the ids of the node's open commands this call
	// failed (CommandErrTextNodeRevoked), in id order.
	CommandsFailed []string
}

// CommandErrTextNodeRevoked is the error of the commands still open on a
// node when it is revoked: its session is closed and will not open again,
// so they would otherwise sit open until their deadline. A command the
// daemon had started may or may not have run.
const CommandErrTextNodeRevoked = "node revoked before the command finished"

// RevokeNode revokes node nodeID at now: it sets nodes.revoked_at and
// nodes.revoke_reason to reason (both kept when the node was already
// revoked: the first revocation's time and reason stand), revokes every
// certificate of the node not yet revoked,
// writes a node.revoked event for the pool owner's tenant (with reason) when
// the node was not revoked before, and pokes the gateway holding the node's
// session so that it closes it. The node's open commands (queued, delivered,
// running) fail with CommandErrTextNodeRevoked, each with its command.failed
// event (user commands; the acceptance reconciler reads its own). Call it in
// a transaction (with the caller's audit row). Errors: ErrNotFound when the
// node does not exist or scope does not include its pool's owner.
func RevokeNode(ctx context.Context, q DBTX, scope Scope, now time.Time, nodeID, reason string) (RevokedNode, error) {
	var out RevokedNode
	var owner string
	// Updating the node first locks it: a concurrent renewal
	// (LockSessionCert) waits for this transaction and then sees it.
	err := q.QueryRow(ctx, `WITH prev AS (
			SELECT n.id, n.revoked_at FROM nodes n JOIN pools p ON p.id = n.pool_id
			WHERE n.id = $1 AND ($4::text IS NULL OR p.owner_tenant_id = $4) FOR UPDATE OF n)
		UPDATE nodes n SET revoked_at = COALESCE(prev.revoked_at, $2),
			revoke_reason = CASE WHEN prev.revoked_at IS NULL THEN $3 ELSE n.revoke_reason END,
			updated_at = CASE WHEN prev.revoked_at IS NULL THEN $2 ELSE n.updated_at END
		FROM prev, pools p WHERE n.id = prev.id AND p.id = n.pool_id
		RETURNING n.revoked_at, n.revoke_reason, prev.revoked_at IS NULL, p.owner_tenant_id`, nodeID, now, reason,
		scope.arg()).
		Scan(&out.RevokedAt, &out.Reason, &out.Newly, &owner)
	if err != nil {
		return RevokedNode{}, queryErr(fmt.Sprintf("node %s", nodeID), err)
	}
	tag, err := q.Exec(ctx, `UPDATE node_certs SET revoked_at = $2 WHERE node_id = $1 AND revoked_at IS NULL`, nodeID, now)
	if err != nil {
		return RevokedNode{}, fmt.Errorf("revoke the certificates of node %s: %w", nodeID, interpretError(err))
	}
	out.CertificatesRevoked = int(tag.RowsAffected())
	rows, err := q.Query(ctx, `UPDATE commands SET state = 'failed', error = $3, finished_at = $2, updated_at = $2
		WHERE node_id = $1 AND finished_at IS NULL RETURNING id`, nodeID, now, CommandErrTextNodeRevoked)
	if err != nil {
		return RevokedNode{}, fmt.Errorf("fail the open commands of node %s: %w", nodeID, interpretError(err))
	}
	failed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return RevokedNode{}, fmt.Errorf("fail the open commands of node %s: %w", nodeID, interpretError(err))
	}
	if len(failed) > 0 {
		cmds, err := commandsByID(ctx, q, failed)
		if err != nil {
			return RevokedNode{}, err
		}
		user := slices.DeleteFunc(cmds, func(c Command) bool { return c.Purpose != "user" })
		if err := writeCommandEndedEvents(ctx, q, now, user); err != nil {
			return RevokedNode{}, err
		}
		out.CommandsFailed = slices.Sorted(slices.Values(failed))
	}
	if out.Newly {
		if err := WriteEvents(ctx, q, now, NewEvent{TenantID: owner, Data: NodeRevokedData{NodeID: nodeID, Reason: reason,
			CertificatesRevoked: out.CertificatesRevoked}}); err != nil {
			return RevokedNode{}, err
		}
	}
	if err := PokeNodes(ctx, q, now, nodeID); err != nil {
		return RevokedNode{}, err
	}
	return out, nil
}

// RecordSpecRefused writes a node.spec_refused event for the pool owner's
// tenant: the node's daemon refused DesiredState generation with reason.
// Errors: ErrNotFound when the node does not exist.
func RecordSpecRefused(ctx context.Context, q DBTX, now time.Time, nodeID string, generation int64, reason string) error {
	var owner string
	err := q.QueryRow(ctx, `SELECT p.owner_tenant_id FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE n.id = $1`,
		nodeID).Scan(&owner)
	if err != nil {
		return queryErr(fmt.Sprintf("node %s", nodeID), err)
	}
	return WriteEvents(ctx, q, now, NewEvent{TenantID: owner,
		Data: NodeSpecRefusedData{NodeID: nodeID, Generation: generation, Reason: reason}})
}
