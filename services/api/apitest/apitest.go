// Package apitest runs the API server in-process for tests of its clients
// (the CLI, end-to-end suites): an httptest server over the real handler and
// a helper to mint API tokens.
package apitest

import (
	"net/http/httptest"
	"testing"

	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
)

// Start serves the API over db on a loopback httptest server, closed when the
// test ends, and returns its base URL (without /api/compute).
func Start(t testing.TB, db *store.DB) string {
	t.Helper()
	srv, err := api.New(api.Config{}, api.Deps{DB: db, Logger: telemetry.Discard()})
	if err != nil {
		t.Fatalf("apitest: %v", err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
	})
	return ts.URL
}

// Tenant creates a tenant named name and returns its id.
func Tenant(t testing.TB, db *store.DB, name string) string {
	t.Helper()
	now := db.Now()
	tn := store.Tenant{ID: ids.New(ids.Tenant, now), Name: name, CreatedAt: now}
	if err := store.CreateTenant(t.Context(), db.Pool, tn); err != nil {
		t.Fatalf("apitest: %v", err)
	}
	return tn.ID
}

// Token mints an API token of tenantID with role and returns its secret.
func Token(t testing.TB, db *store.DB, tenantID string, role iam.Role) string {
	t.Helper()
	secret, _, err := iam.MintAPIToken(t.Context(), db.Pool, db.Now(), tenantID, string(role), role, nil)
	if err != nil {
		t.Fatalf("apitest: %v", err)
	}
	return secret
}
