package store

// The audit log: one row per mutating API call, written in the call's
// transaction.

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// AuditEntry is a row of audit: one mutating API call, allowed or refused.
type AuditEntry struct {
	// ID orders the rows (bigserial); set by InsertAudit.
	ID int64
	At time.Time
	// TenantID, TokenID and Role are the caller's; empty for an
	// unauthenticated call.
	TenantID string
	TokenID  string
	Role     string
	// Procedure is the Connect procedure, e.g.
	// "/bc.compute.v1.TokenService/RevokeToken".
	Procedure string
	// Target is the id (or, for a refused create, the name) of the resource
	// acted on; empty when there is none.
	Target string
	// Outcome is "ok" or the Connect code of the refusal in snake_case
	// ("permission_denied").
	Outcome string
	// Detail is the refusal's message, or what a successful call changed.
	Detail string
}

// InsertAudit appends e and returns its id. Call it in the transaction of
// the change it records, so that the row and the change commit together.
func InsertAudit(ctx context.Context, q DBTX, e AuditEntry) (int64, error) {
	var id int64
	err := q.QueryRow(ctx, `INSERT INTO audit (at, tenant_id, token_id, role, procedure, target, outcome, detail)
		VALUES ($1, NULLIF($2, ''), NULLIF($3, ''), $4, $5, $6, $7, $8) RETURNING id`,
		e.At, e.TenantID, e.TokenID, e.Role, e.Procedure, e.Target, e.Outcome, e.Detail).Scan(&id)
	if err != nil {
		return 0, queryErr("insert audit row", err)
	}
	return id, nil
}

// InsertAudits writes entries in one statement, in their order.
func InsertAudits(ctx context.Context, q DBTX, entries []AuditEntry) error {
	if len(entries) == 0 {
		return nil
	}
	n := len(entries)
	at := make([]time.Time, n)
	tenant, token, role, proc, target, outcome, detail := make([]string, n), make([]string, n), make([]string, n),
		make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	for i, e := range entries {
		at[i], tenant[i], token[i], role[i], proc[i], target[i], outcome[i], detail[i] =
			e.At, e.TenantID, e.TokenID, e.Role, e.Procedure, e.Target, e.Outcome, e.Detail
	}
	_, err := q.Exec(ctx, `INSERT INTO audit (at, tenant_id, token_id, role, procedure, target, outcome, detail)
		SELECT u.at, NULLIF(u.tenant, ''), NULLIF(u.token, ''), u.role, u.proc, u.target, u.outcome, u.detail
		FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
			WITH ORDINALITY AS u(at, tenant, token, role, proc, target, outcome, detail, ord)
		ORDER BY u.ord`, at, tenant, token, role, proc, target, outcome, detail)
	if err != nil {
		return queryErr("insert audit rows", err)
	}
	return nil
}

// AuditFilter selects audit rows for ListAudit.
type AuditFilter struct {
	// Scope selects its tenants' rows; AllTenants selects every row,
	// unauthenticated calls included (the zero Scope: none).
	Scope Scope
	// Before, when positive, selects rows with a smaller id (the previous
	// page's last id).
	Before int64
	// Limit caps the rows returned; it must be positive.
	Limit int
}

// ListAudit returns the rows matching f, newest (highest id) first.
func ListAudit(ctx context.Context, q DBTX, f AuditFilter) ([]AuditEntry, error) {
	rows, err := q.Query(ctx, `SELECT id, at, COALESCE(tenant_id, ''), COALESCE(token_id, ''), role, procedure, target,
			outcome, detail
		FROM audit WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2 <= 0 OR id < $2)
		ORDER BY id DESC LIMIT $3`, f.Scope.arg(), f.Before, f.Limit)
	if err != nil {
		return nil, queryErr("list audit", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		var e AuditEntry
		err := r.Scan(&e.ID, &e.At, &e.TenantID, &e.TokenID, &e.Role, &e.Procedure, &e.Target, &e.Outcome, &e.Detail)
		return e, err
	})
	if err != nil {
		return nil, queryErr("list audit", err)
	}
	return out, nil
}
