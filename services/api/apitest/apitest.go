// Package apitest runs the API server in-process for tests of its clients
// (the CLI, end-to-end suites), through the service lifecycle on a loopback
// port, and has helpers to mint API tokens.
package apitest

import (
	"context"
	"net"
	"testing"

	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
)

// Start runs the API over db on a loopback port (api.Server.Run, probes
// included), stopped when the test ends, and returns its base URL (without
// /api/compute).
func Start(t testing.TB, db *store.DB) string {
	t.Helper()
	return StartWith(t, db, api.Config{})
}

// StartWith is Start with the settings of cfg (a PKI directory, tunnel
// limits, TLS, …); its Listener is the loopback port's. With TLS the base
// URL is https://127.0.0.1:PORT.
func StartWith(t testing.TB, db *store.DB, cfg api.Config) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("apitest: %v", err)
	}
	cfg.Listener = ln
	srv, err := api.New(cfg, api.Deps{DB: db, Logger: telemetry.Discard()})
	if err != nil {
		ln.Close()
		t.Fatalf("apitest: %v", err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	errc := make(chan error, 1)
	go func() { errc <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("apitest: the API server stopped with %v", err)
		}
	})
	if cfg.TLSCert != "" {
		return "https://" + ln.Addr().String()
	}
	return "http://" + ln.Addr().String()
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
