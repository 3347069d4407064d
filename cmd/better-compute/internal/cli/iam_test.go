package cli_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

func TestTenantsTokensAndAudit(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)

	// A tenant, and an admin token for it (the secret printed once).
	res := root.run(t, "tenants", "create", "acme")
	require.Equal(t, 0, res.code, res.stderr)
	acme := strings.TrimSpace(res.stdout)
	require.NoError(t, ids.Check(ids.Tenant, acme))
	res = root.run(t, "tenants", "create", "acme-eu", "--parent", acme)
	require.Equal(t, 0, res.code, res.stderr)
	res = root.run(t, "tenants", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var tenants []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &tenants))
	require.Len(t, tenants, 3)
	require.Equal(t, "acme-eu", tenants[2]["name"])
	require.Equal(t, acme, tenants[2]["parent"])
	require.Equal(t, "", tenants[0]["parent"], "the root tenant has no parent")

	res = root.run(t, "tokens", "create", "--name", "acme-ops", "--role", "tenant-admin", "--tenant", acme, "--ttl", "24h")
	require.Equal(t, 0, res.code, res.stderr)
	adminSecret := strings.TrimSpace(res.stdout)
	_, err := iam.ParseBearer("Bearer " + adminSecret)
	require.NoError(t, err, "standard output is the secret alone")
	require.Contains(t, res.stderr, "of tenant "+acme+", role tenant-admin, expires ")
	require.Contains(t, res.stderr, "shown only once")

	admin := f.runner(adminSecret)
	res = admin.run(t, "tenants", "list")
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimSpace(res.stdout), "\n")
	require.Len(t, lines, 2, "its own tenant only:\n%s", res.stdout)
	require.Equal(t, []string{"ID", "NAME", "PARENT", "CREATED"}, strings.Fields(lines[0]))
	require.Equal(t, []string{acme, "acme", f.tenant}, strings.Fields(lines[1])[:3])

	// A token may not outlive the one that mints it.
	res = admin.run(t, "tokens", "create", "--name", "ci", "--role", "viewer")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "--ttl: a token may not outlive the token that mints it")
	res = admin.run(t, "tokens", "create", "--name", "ci", "--role", "viewer", "--ttl", "1h")
	require.Equal(t, 0, res.code, res.stderr)
	viewerSecret := strings.TrimSpace(res.stdout)
	require.Contains(t, res.stderr, "role viewer, expires ")
	viewerTok, err := store.GetAPITokenByHash(t.Context(), f.db.Pool, iam.HashSecret(viewerSecret))
	require.NoError(t, err)
	require.Equal(t, acme, viewerTok.TenantID)

	res = admin.run(t, "tokens", "list")
	require.Equal(t, 0, res.code, res.stderr)
	require.NotContains(t, res.stdout, viewerSecret)
	lines = strings.Split(strings.TrimSpace(res.stdout), "\n")
	require.Len(t, lines, 3, res.stdout)
	require.Equal(t, []string{"ID", "NAME", "ROLE", "TENANT", "EXPIRES", "LAST", "USED", "STATE"}, strings.Fields(lines[0]))
	require.Equal(t, []string{viewerTok.ID, "ci", "viewer", acme, viewerTok.ExpiresAt.UTC().Format(time.RFC3339), "never", "active"},
		strings.Fields(lines[2]))

	res = admin.run(t, "tokens", "revoke", viewerTok.ID)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "revoked "+viewerTok.ID+" at ")
	res = f.runner(viewerSecret).run(t, "pools", "list")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: unauthenticated: api token was revoked\n", res.stderr)
	res = admin.run(t, "tokens", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var toks []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &toks))
	require.Len(t, toks, 2)
	require.Equal(t, "ci", toks[1]["name"])
	require.NotNil(t, toks[1]["revokedAt"])
	require.NotNil(t, toks[0]["lastUsedAt"], "the admin token was used")

	// Refusals: another tenant's tokens, a root-admin token, a viewer.
	res = admin.run(t, "tokens", "list", "--tenant", f.tenant)
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: not_found: --tenant: tenant "+f.tenant+" not found\n", res.stderr)
	res = admin.run(t, "tokens", "create", "--name", "x", "--role", "root-admin")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: permission_denied: --role: a tenant-admin may not mint root-admin tokens\n", res.stderr)
	res = f.runner(f.viewer).run(t, "tokens", "list")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: permission_denied: role viewer may not call ListTokens (needs iam.manage)\n", res.stderr)
	res = admin.run(t, "tokens", "create", "--name", "x", "--role", "admin")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "error: --role: unknown role \"admin\"")
	res = admin.run(t, "tokens", "create", "--name", "x", "--role", "viewer", "--ttl", "1.5s")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "--ttl must be a whole number of seconds")

	// The audit log: the admin sees its tenant's calls, root sees all.
	res = admin.run(t, "audit", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var rows []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &rows))
	var calls []string
	for _, r := range rows {
		require.Equal(t, acme, r["tenant"])
		calls = append(calls, r["procedure"].(string)+" "+r["outcome"].(string))
	}
	require.Equal(t, []string{
		"/bc.compute.v1.TokenService/CreateToken permission_denied",
		"/bc.compute.v1.TokenService/RevokeToken ok",
		"/bc.compute.v1.TokenService/CreateToken ok",
		"/bc.compute.v1.TokenService/CreateToken invalid_argument",
	}, calls, "newest first; reads and calls the CLI refused itself are not audited")
	res = admin.run(t, "audit", "list", "--limit", "1")
	require.Equal(t, 0, res.code, res.stderr)
	lines = strings.Split(strings.TrimSpace(res.stdout), "\n")
	require.Len(t, lines, 2)
	require.Equal(t, []string{"ID", "AT", "TENANT", "TOKEN", "ROLE", "CALL", "TARGET", "OUTCOME", "DETAIL"}, strings.Fields(lines[0]))
	fields := strings.Fields(lines[1])
	require.Equal(t, []string{acme, "tenant-admin", "TokenService/CreateToken", "-", "permission_denied", "role:"},
		append(fields[2:3:3], fields[4:9]...))
	require.True(t, strings.HasPrefix(fields[3], "tok_"), "the caller's token id: %q", fields[3])

	res = root.run(t, "audit", "list", "--limit", "3", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &rows))
	require.Len(t, rows, 3, "pages up to --limit")
	res = root.run(t, "audit", "list", "--limit", "100", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &rows))
	require.Len(t, rows, 7, "every tenant's rows: root's 3 (2 tenants, 1 token), acme's 4")
	res = root.run(t, "audit", "list", "--limit", "0")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: --limit must be at least 1\n", res.stderr)
}

func TestRoleCompletion(t *testing.T) {
	t.Parallel()
	res := runner{env: map[string]string{}}.run(t, "__complete", "tokens", "create", "--role", "")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, []string{"root-admin", "tenant-admin", "tenant-member", "viewer", ":4"},
		strings.Fields(res.stdout))
	res = runner{env: map[string]string{}}.run(t, "__complete", "tokens", "create", "--role", "ten")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "tenant-admin")
}

// TestTokenTTLs: a bad --ttl of tokens create and join-tokens create is
// refused by the CLI with an error naming --ttl that says what is wrong
// (a negative one used to be called "not a whole number of seconds"), and
// mints nothing; an explicit 0 is refused too (leaving --ttl out of tokens
// create is how to mint a token that never expires).
func TestTokenTTLs(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	for _, tc := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"tokens", "create", "--name", "x", "--role", "viewer", "--ttl", "-1s"},
			"error: --ttl must be positive (1s to 8784h (366 days)), got -1s; leave --ttl out for a token that never expires\n"},
		{[]string{"tokens", "create", "--name", "x", "--role", "viewer", "--ttl", "0"},
			"error: --ttl must be positive (1s to 8784h (366 days)), got 0s; leave --ttl out for a token that never expires\n"},
		{[]string{"tokens", "create", "--name", "x", "--role", "viewer", "--ttl", "1.5s"},
			"error: --ttl must be a whole number of seconds, got 1.5s\n"},
		{[]string{"tokens", "create", "--name", "x", "--role", "viewer", "--ttl", "8785h"},
			"error: --ttl must be at most 8784h (366 days), got 8785h0m0s\n"},
		{[]string{"join-tokens", "create", "--pool", f.poolID, "--ttl", "-1s"},
			"error: --ttl must be positive (1s to 720h (30 days)), got -1s\n"},
		{[]string{"join-tokens", "create", "--pool", f.poolID, "--ttl", "0"},
			"error: --ttl must be positive (1s to 720h (30 days)), got 0s\n"},
		{[]string{"join-tokens", "create", "--pool", f.poolID, "--ttl", "721h"},
			"error: --ttl must be at most 720h (30 days), got 721h0m0s\n"},
	} {
		res := root.run(t, tc.args...)
		require.Equal(t, 1, res.code, "%v: %s", tc.args, res.stdout)
		require.Equal(t, tc.stderr, res.stderr, "%v", tc.args)
		require.Empty(t, res.stdout)
	}
	var minted int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(),
		`SELECT (SELECT count(*) FROM api_tokens WHERE name = 'x') + (SELECT count(*) FROM join_tokens)`).Scan(&minted))
	require.Zero(t, minted)

	res := root.run(t, "tokens", "create", "--name", "forever", "--role", "viewer")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stderr, "never expires")
	res = root.run(t, "tokens", "create", "--name", "day", "--role", "viewer", "--ttl", "8784h")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stderr, ", expires ")
}
