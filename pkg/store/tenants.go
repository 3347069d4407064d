package store

// Tenants: a tree under the root tenant, each owning pools and tokens.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Tenant is a row of tenants: an organisation that owns pools and tokens.
// Tenants form a tree under the root tenant (ParentID); the tree is
// structure only: a tenant's rights never reach its children.
type Tenant struct {
	ID   string
	Name string
	// ParentID is the parent tenant's id, empty for a top-level tenant.
	ParentID  string
	CreatedAt time.Time
}

// ConstraintTenantName makes tenant names unique, for IsConstraint.
const ConstraintTenantName = "tenants_name_key"

const tenantColumns = `id, name, COALESCE(parent_id, ''), created_at`

func scanTenant(row pgx.Row) (Tenant, error) {
	var t Tenant
	err := row.Scan(&t.ID, &t.Name, &t.ParentID, &t.CreatedAt)
	return t, err
}

// CreateTenant inserts t. Errors: ErrConflict (ConstraintTenantName) when
// the name is taken; the parent must exist (check it in the same
// transaction: a missing parent is a foreign-key error).
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

// TenantFilter selects tenants for ListTenants; zero fields other than
// Scope select all.
type TenantFilter struct {
	// Scope selects the tenants it includes: one tenant, or all (the zero
	// Scope: none).
	Scope Scope
	// ParentID selects the children of a tenant.
	ParentID string
}

// ListTenants returns the tenants matching f, ordered by id (creation time).
func ListTenants(ctx context.Context, q DBTX, f TenantFilter) ([]Tenant, error) {
	rows, err := q.Query(ctx, `SELECT `+tenantColumns+` FROM tenants
		WHERE ($1::text IS NULL OR id = $1) AND ($2 = '' OR parent_id = $2) ORDER BY id`, f.Scope.arg(), f.ParentID)
	if err != nil {
		return nil, queryErr("list tenants", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
	if err != nil {
		return nil, queryErr("list tenants", err)
	}
	return out, nil
}
