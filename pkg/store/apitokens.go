package store

// API tokens of tenants (api_tokens): created, looked up by the hash of
// their secret, touched, listed and revoked; a revocation tells every API
// server through the outbox.

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// APIToken is a row of api_tokens: a bearer credential of one tenant with
// one role. Only the SHA-256 of the secret is stored (Hash).
type APIToken struct {
	ID       string
	TenantID string
	Name     string
	// Hash is SHA-256 of the token's secret.
	Hash []byte
	// Role is root-admin, tenant-admin, tenant-member or viewer.
	Role string
	// ExpiresAt is when the token stops working; nil never expires.
	ExpiresAt *time.Time
	// RevokedAt is when the token was revoked; nil while it is not.
	RevokedAt  *time.Time
	CreatedAt  time.Time
	LastUsedAt *time.Time
}

const apiTokenColumns = `id, tenant_id, name, hash, role, expires_at, revoked_at, created_at, last_used_at`

func scanAPIToken(row pgx.Row) (APIToken, error) {
	var t APIToken
	err := row.Scan(&t.ID, &t.TenantID, &t.Name, &t.Hash, &t.Role, &t.ExpiresAt, &t.RevokedAt, &t.CreatedAt, &t.LastUsedAt)
	return t, err
}

// CreateAPIToken inserts t. Errors: ErrConflict when the hash exists.
func CreateAPIToken(ctx context.Context, q DBTX, t APIToken) error {
	_, err := q.Exec(ctx, `INSERT INTO api_tokens (id, tenant_id, name, hash, role, expires_at, created_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7)`, t.ID, t.TenantID, t.Name, t.Hash, t.Role, t.ExpiresAt, t.CreatedAt)
	if err != nil {
		return queryErr("create api token", err)
	}
	return nil
}

// GetAPITokenByHash returns the token whose secret hashes to hash, whether
// or not it is expired or revoked (the caller decides). Errors: ErrNotFound.
func GetAPITokenByHash(ctx context.Context, q DBTX, hash []byte) (APIToken, error) {
	t, err := scanAPIToken(q.QueryRow(ctx, `SELECT `+apiTokenColumns+` FROM api_tokens WHERE hash = $1`, hash))
	if err != nil {
		return APIToken{}, queryErr("api token", err)
	}
	return t, nil
}

// APITokenTouchInterval is how stale api_tokens.last_used_at may get:
// TouchAPIToken writes at most once per interval per token.
const APITokenTouchInterval = time.Minute

// TouchAPIToken records that token id was used at now. It writes at most
// once per APITokenTouchInterval per token, so that authenticating is not a
// write per request.
func TouchAPIToken(ctx context.Context, q DBTX, id string, now time.Time) error {
	_, err := q.Exec(ctx, `UPDATE api_tokens SET last_used_at = $2
		WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < $3)`, id, now, now.Add(-APITokenTouchInterval))
	if err != nil {
		return queryErr("touch api token", err)
	}
	return nil
}

// GetAPIToken returns the token with id when scope includes its tenant.
// Errors: ErrNotFound (missing, or outside scope).
func GetAPIToken(ctx context.Context, q DBTX, scope Scope, id string) (APIToken, error) {
	t, err := scanAPIToken(q.QueryRow(ctx, `SELECT `+apiTokenColumns+` FROM api_tokens
		WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)`, id, scope.arg()))
	if err != nil {
		return APIToken{}, queryErr("api token "+id, err)
	}
	return t, nil
}

// ListAPITokens returns the tokens of scope's tenants, oldest first,
// revoked and expired ones included.
func ListAPITokens(ctx context.Context, q DBTX, scope Scope) ([]APIToken, error) {
	rows, err := q.Query(ctx, `SELECT `+apiTokenColumns+` FROM api_tokens
		WHERE ($1::text IS NULL OR tenant_id = $1) ORDER BY created_at, id`, scope.arg())
	if err != nil {
		return nil, queryErr("list api tokens", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (APIToken, error) { return scanAPIToken(r) })
	if err != nil {
		return nil, queryErr("list api tokens", err)
	}
	return out, nil
}

// RevokeAPIToken revokes token id at now, keeping an earlier revocation
// time, and in the same statement writes an outbox message on
// SubjectAPITokenRevoked (payload APITokenRevoked) so that every API server
// drops the token from its cache once the change commits; revoking again
// writes another, harmless, message. Errors: ErrNotFound (missing, or its
// tenant outside scope).
func RevokeAPIToken(ctx context.Context, q DBTX, scope Scope, id string, now time.Time) error {
	payload, err := json.Marshal(APITokenRevoked{TokenID: id})
	if err != nil {
		return fmt.Errorf("revoke api token: %w", err)
	}
	tag, err := q.Exec(ctx, `WITH t AS (
			UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $2)
			WHERE id = $1 AND ($5::text IS NULL OR tenant_id = $5) RETURNING id)
		INSERT INTO outbox (subject, payload, created_at) SELECT $3, $4, $2 FROM t`,
		id, now, SubjectAPITokenRevoked, payload, scope.arg())
	if err != nil {
		return queryErr("revoke api token", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("api token %s: %w", id, ErrNotFound)
	}
	return signalOutbox(ctx, q)
}

// RootAdminExpiryMargin is how long a root-admin token must still last to
// count as a remaining root administrator (CountLiveRootAdminTokens): one
// that expires sooner would leave the control plane without one as soon as
// it does.
const RootAdminExpiryMargin = time.Hour

// CountLiveRootAdminTokens locks the live root-admin tokens other than
// exceptID and returns how many there are, so that a revocation can refuse
// to remove the last one; concurrent callers serialise on the locks. Live
// is not revoked and not expiring within RootAdminExpiryMargin of now.
func CountLiveRootAdminTokens(ctx context.Context, q DBTX, now time.Time, exceptID string) (int, error) {
	rows, err := q.Query(ctx, `SELECT id FROM api_tokens
		WHERE role = 'root-admin' AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > $1) AND id <> $2
		ORDER BY id FOR UPDATE`, now.Add(RootAdminExpiryMargin), exceptID)
	if err != nil {
		return 0, queryErr("count root-admin tokens", err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Err()
}
