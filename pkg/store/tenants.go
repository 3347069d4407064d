package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Tenant is a row of tenants: an organisation that owns pools and tokens.
type Tenant struct {
	ID   string
	Name string
	// ParentID is the parent tenant's id, empty for a top-level tenant.
	ParentID  string
	CreatedAt time.Time
}

// queryErr names what a query was about and interprets err: no rows become
// ErrNotFound without the driver error (so that InTx does not wrap it
// twice), constraint violations become ConstraintError.
func queryErr(what string, err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%s: %w", what, ErrNotFound)
	}
	return fmt.Errorf("%s: %w", what, interpretError(err))
}

const tenantColumns = `id, name, COALESCE(parent_id, ''), created_at`

func scanTenant(row pgx.Row) (Tenant, error) {
	var t Tenant
	err := row.Scan(&t.ID, &t.Name, &t.ParentID, &t.CreatedAt)
	return t, err
}

// CreateTenant inserts t. Errors: ErrConflict when the name is taken.
func CreateTenant(ctx context.Context, q DBTX, t Tenant) error {
	_, err := q.Exec(ctx, `INSERT INTO tenants (id, name, parent_id, created_at) VALUES ($1, $2, NULLIF($3, ''), $4)`,
		t.ID, t.Name, t.ParentID, t.CreatedAt)
	if err != nil {
		return queryErr(fmt.Sprintf("create tenant %q", t.Name), err)
	}
	return nil
}

// EnsureTenant returns the tenant named t.Name, inserting t first when no
// tenant has that name. Concurrent callers get the same row.
func EnsureTenant(ctx context.Context, q DBTX, t Tenant) (Tenant, error) {
	_, err := q.Exec(ctx, `INSERT INTO tenants (id, name, parent_id, created_at) VALUES ($1, $2, NULLIF($3, ''), $4)
		ON CONFLICT (name) DO NOTHING`, t.ID, t.Name, t.ParentID, t.CreatedAt)
	if err != nil {
		return Tenant{}, queryErr(fmt.Sprintf("ensure tenant %q", t.Name), err)
	}
	return GetTenantByName(ctx, q, t.Name)
}

// GetTenant returns the tenant with id. Errors: ErrNotFound.
func GetTenant(ctx context.Context, q DBTX, id string) (Tenant, error) {
	t, err := scanTenant(q.QueryRow(ctx, `SELECT `+tenantColumns+` FROM tenants WHERE id = $1`, id))
	if err != nil {
		return Tenant{}, queryErr(fmt.Sprintf("tenant %s", id), err)
	}
	return t, nil
}

// GetTenantByName returns the tenant named name. Errors: ErrNotFound.
func GetTenantByName(ctx context.Context, q DBTX, name string) (Tenant, error) {
	t, err := scanTenant(q.QueryRow(ctx, `SELECT `+tenantColumns+` FROM tenants WHERE name = $1`, name))
	if err != nil {
		return Tenant{}, queryErr(fmt.Sprintf("tenant %q", name), err)
	}
	return t, nil
}

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

// TouchAPIToken records that token id was used at now. It writes at most
// once per minute per token, so that authenticating is not a write per
// request.
func TouchAPIToken(ctx context.Context, q DBTX, id string, now time.Time) error {
	_, err := q.Exec(ctx, `UPDATE api_tokens SET last_used_at = $2
		WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < $2::timestamptz - interval '1 minute')`, id, now)
	if err != nil {
		return queryErr("touch api token", err)
	}
	return nil
}

// RevokeAPIToken revokes token id at now, keeping an earlier revocation
// time. Errors: ErrNotFound.
func RevokeAPIToken(ctx context.Context, q DBTX, id string, now time.Time) error {
	tag, err := q.Exec(ctx, `UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1`, id, now)
	if err != nil {
		return queryErr("revoke api token", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("api token %s: %w", id, ErrNotFound)
	}
	return nil
}
