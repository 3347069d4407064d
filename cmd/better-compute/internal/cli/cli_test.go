package cli_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/apitest"
)

func TestMain(m *testing.M) {
	if os.Getenv(cliSubprocessEnv) == "1" {
		// The test binary as the CLI, for tests that run it on a
		// pseudo-terminal (console_test.go).
		os.Exit(runCLISubprocess())
	}
	code := m.Run()
	storetest.Stop()
	os.Exit(code)
}

// runner runs the CLI in-process with its own environment and clock.
type runner struct {
	env map[string]string
	clk clock.Clock
}

type result struct {
	code           int
	stdout, stderr string
}

func (r runner) run(t *testing.T, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	clk := r.clk
	if clk == nil {
		clk = clock.New()
	}
	code := cli.Run(t.Context(), args, cli.Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return r.env[k] }, Clock: clk})
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

// fleet is an API server over a database with a tenant, a pool and nodes.
type fleet struct {
	db              *store.DB
	url             string
	tenant          string
	root, viewer    string
	siteID, poolID  string
	now             time.Time
	adopted, failed string
	joining         string
}

func newFleet(t *testing.T) *fleet {
	t.Helper()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	f := &fleet{db: db, url: apitest.Start(t, db), now: db.Now().Truncate(time.Second)}
	f.tenant = apitest.Tenant(t, db, "root")
	f.root = apitest.Token(t, db, f.tenant, iam.RoleRootAdmin)
	f.viewer = apitest.Token(t, db, f.tenant, iam.RoleViewer)
	f.siteID = ids.New(ids.Site, f.now)
	require.NoError(t, store.CreateSite(ctx, db.Pool, store.Site{ID: f.siteID, Name: "dev-1", Region: "dev-1", CreatedAt: f.now}))
	f.poolID = ids.New(ids.Pool, f.now)
	require.NoError(t, store.CreatePool(ctx, db.Pool, store.Pool{ID: f.poolID, SiteID: f.siteID, OwnerTenantID: f.tenant,
		Name: "metal-host", Kind: "metal-host", GPUModel: "H100", ExpectGPUCount: 8, CreatedAt: f.now}))

	node := func(o storetest.NodeOpts) string {
		o.PoolID, o.CreatedAt = f.poolID, f.now
		return storetest.Node(t, db, &o).ID
	}
	f.adopted = node(storetest.NodeOpts{GPUs: 8, State: store.NodeAdopted, GatewayID: "gw-a", LastSeen: f.now.Add(-3 * time.Second),
		Reachable: true})
	f.failed = node(storetest.NodeOpts{GPUs: 7, State: store.NodeAcceptanceFailed, Reason: "expected 8 GPUs, found 7",
		GatewayID: "gw-b", LastSeen: f.now.Add(-5 * time.Minute), Reachable: true})
	f.joining = node(storetest.NodeOpts{})
	return f
}

func (f *fleet) runner(token string) runner {
	return runner{env: map[string]string{"BETTER_COMPUTE_URL": f.url, "BETTER_COMPUTE_TOKEN": token}, clk: clock.NewFake(f.now)}
}

func TestNodesList(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.viewer)

	res := r.run(t, "nodes", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var nodes []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &nodes), res.stdout)
	require.Len(t, nodes, 3)
	byID := map[string]map[string]any{}
	for _, n := range nodes {
		for _, k := range []string{"id", "pool", "state", "reason", "gpus", "model", "gateway", "lastSeen"} {
			require.Contains(t, n, k)
		}
		byID[n["id"].(string)] = n
	}
	a := byID[f.adopted]
	require.Equal(t, f.poolID, a["pool"])
	require.Equal(t, "adopted", a["state"])
	require.EqualValues(t, 8, a["gpus"])
	require.Equal(t, "NVIDIA H100 80GB HBM3", a["model"])
	require.Equal(t, "gw-a", a["gateway"])
	seen, err := time.Parse(time.RFC3339, a["lastSeen"].(string))
	require.NoError(t, err)
	require.True(t, seen.Equal(f.now.Add(-3*time.Second)))
	require.Equal(t, "expected 8 GPUs, found 7", byID[f.failed]["reason"])
	require.EqualValues(t, 7, byID[f.failed]["gpus"])
	require.Nil(t, byID[f.joining]["lastSeen"])
	require.EqualValues(t, 0, byID[f.joining]["gpus"])

	res = r.run(t, "nodes", "list")
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Len(t, lines, 4, res.stdout)
	require.Equal(t, []string{"ID", "POOL", "STATE", "GPUS", "MODEL", "GATEWAY", "LAST", "SEEN", "REASON"}, strings.Fields(lines[0]))
	row := func(id string) string {
		for _, l := range lines[1:] {
			if strings.HasPrefix(l, id) {
				return l
			}
		}
		t.Fatalf("no row for %s in\n%s", id, res.stdout)
		return ""
	}
	require.Equal(t, []string{f.adopted, f.poolID, "adopted", "8", "NVIDIA", "H100", "80GB", "HBM3", "gw-a", "3s", "ago"},
		strings.Fields(row(f.adopted)))
	require.Equal(t, []string{f.failed, f.poolID, "acceptance_failed", "7", "NVIDIA", "H100", "80GB", "HBM3", "gw-b", "5m", "ago",
		"expected", "8", "GPUs,", "found", "7"}, strings.Fields(row(f.failed)))
	require.Equal(t, []string{f.joining, f.poolID, "joining", "0", "-", "-", "never"}, strings.Fields(row(f.joining)))

	res = r.run(t, "nodes", "list", "--pool", f.poolID, "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &nodes))
	require.Len(t, nodes, 3)

	res = r.run(t, "nodes", "list", "--pool", "pool_nope")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: not_found: --pool: pool pool_nope not found\n", res.stderr)

	res = r.run(t, "nodes", "get", f.failed)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, `"reason": "expected 8 GPUs, found 7"`)

	// The liveness sweeper, a minute on, marks the adopted node (and the
	// failed one) unreachable: the table says so beside its state, the JSON
	// has reachable false.
	_, err = store.SweepUnreachable(t.Context(), f.db.Pool, f.db.Now().Add(time.Minute), store.MinLivenessTimeout, 10)
	require.NoError(t, err)
	res = r.run(t, "nodes", "list")
	require.Equal(t, 0, res.code, res.stderr)
	lines = strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Equal(t, "adopted,unreachable", strings.Fields(row(f.adopted))[2])
	require.Equal(t, "joining", strings.Fields(row(f.joining))[2], "a node never heard from is not called unreachable")
	res = r.run(t, "nodes", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, `"reachable": false`)
}

func TestErrors(t *testing.T) {
	t.Parallel()
	f := newFleet(t)

	for _, tc := range []struct {
		name   string
		r      runner
		args   []string
		stderr string
	}{
		{"bad token", f.runner("bct_nope"), []string{"nodes", "list"}, "error: unauthenticated: api token is not valid\n"},
		{"no token", runner{env: map[string]string{"BETTER_COMPUTE_URL": f.url}}, []string{"pools", "list"},
			"error: no API token: set BETTER_COMPUTE_TOKEN or pass --token\n"},
		{"viewer creates a pool", f.runner(f.viewer), []string{"pools", "create", "x", "--site", f.siteID},
			"error: permission_denied: role viewer may not call CreatePool (needs fleet.manage)\n"},
		{"bad output", f.runner(f.viewer), []string{"pools", "list", "-o", "yaml"},
			"error: -o: unknown output format \"yaml\" (want table or json)\n"},
		{"missing flag", f.runner(f.root), []string{"join-tokens", "create"},
			"error: required flag(s) \"pool\" not set\n"},
		{"bad ttl", f.runner(f.root), []string{"join-tokens", "create", "--pool", f.poolID, "--ttl", "soon"},
			"error: invalid argument \"soon\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute join-tokens create --help')\n"},
		{"too many uses", f.runner(f.root), []string{"join-tokens", "create", "--pool", f.poolID, "--max-uses", "0"},
			"error: invalid_argument: --max-uses: must be greater than or equal to 1 and less than or equal to 100000\n"},
		{"bad site name", f.runner(f.root), []string{"sites", "create", "Bad Name", "--region", "eu"}, "error: invalid_argument: NAME: must be lowercase letters, digits and '-', starting and ending with a letter or a digit, at most 63 characters\n"},
		{"site without region", f.runner(f.root), []string{"sites", "create", "eu-2"}, "error: required flag(s) \"region\" not set\n"},
		{"duplicate site", f.runner(f.root), []string{"sites", "create", "dev-1", "--region", "dev-1"},
			"error: already_exists: NAME: a site with this name already exists\n"},
		{"unknown command", f.runner(f.root), []string{"frobnicate"}, "error: unknown command \"frobnicate\" for \"better-compute\"\n"},
		{"bootstrap without region", runner{}, []string{"bootstrap", "--region", " "},
			"error: --region must not be empty: a site is a place in a region\n"},
		{"no database", runner{}, []string{"migrate", "up"}, "error: no database: set BETTER_COMPUTE_DATABASE_URL or pass --database-url\n"},
		{"server down", runner{env: map[string]string{"BETTER_COMPUTE_TOKEN": "bct_x"}},
			[]string{"--url", "http://127.0.0.1:1", "sites", "list"}, "error: unavailable: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := tc.r.run(t, tc.args...)
			require.Equal(t, 1, res.code)
			require.True(t, strings.HasPrefix(res.stderr, tc.stderr), "stderr %q should start with %q", res.stderr, tc.stderr)
			require.Empty(t, res.stdout)
		})
	}
}

func TestPoolsSitesAndJoinTokens(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)

	res := r.run(t, "sites", "list")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, f.siteID)
	require.Contains(t, res.stdout, "dev-1")

	res = r.run(t, "sites", "create", "eu-1", "--region", "eu")
	require.Equal(t, 0, res.code, res.stderr)
	newSite := strings.TrimSpace(res.stdout)
	require.NoError(t, ids.Check(ids.Site, newSite))
	res = r.run(t, "pools", "create", "l40s", "--site", newSite, "--gpu-model", "L40S", "--expect-gpus", "4")
	require.Equal(t, 0, res.code, res.stderr)

	res = r.run(t, "pools", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var pools []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &pools))
	require.Len(t, pools, 2)
	require.Equal(t, map[string]any{"adopted": 1.0, "acceptance_failed": 1.0, "joining": 1.0}, pools[0]["nodes"])
	res = r.run(t, "pools", "list")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "acceptance_failed=1 adopted=1 joining=1")
	require.Contains(t, res.stdout, "L40S")

	// --url overrides BETTER_COMPUTE_URL, --token overrides BETTER_COMPUTE_TOKEN.
	bad := runner{env: map[string]string{"BETTER_COMPUTE_URL": "http://127.0.0.1:1", "BETTER_COMPUTE_TOKEN": "bct_bad"}, clk: r.clk}
	res = bad.run(t, "--url", f.url+"/api/compute/", "--token", f.root, "join-tokens", "create", "--pool", f.poolID,
		"--max-uses", "5", "--ttl", "1h")
	require.Equal(t, 0, res.code, res.stderr)
	secret := strings.TrimSpace(res.stdout)
	require.True(t, strings.HasPrefix(secret, "bcjt_"), secret)
	require.Contains(t, res.stderr, "5 use(s)")
	require.Contains(t, res.stderr, "shown only once")
	jt, err := store.GetJoinTokenByHash(t.Context(), f.db.Pool, iam.HashSecret(secret))
	require.NoError(t, err)
	require.EqualValues(t, 5, jt.MaxUses)

	res = r.run(t, "join-tokens", "list")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, jt.ID)
	require.Contains(t, res.stdout, "0/5")
	require.NotContains(t, res.stdout, secret)
	res = r.run(t, "join-tokens", "revoke", jt.ID)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "revoked "+jt.ID)
	res = r.run(t, "join-tokens", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, `"revokedAt": "`)
}

func TestTenantHeader(t *testing.T) {
	t.Parallel()
	got := make(chan http.Header, 1)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"code":"not_found","message":"nothing here"}`))
	}))
	t.Cleanup(ts.Close)
	r := runner{env: map[string]string{"BETTER_COMPUTE_URL": ts.URL, "BETTER_COMPUTE_TOKEN": "bct_t", "BETTER_COMPUTE_TENANT": "ten_x"}}
	res := r.run(t, "sites", "list")
	require.Equal(t, 1, res.code)
	h := <-got
	require.Equal(t, "Bearer bct_t", h.Get("Authorization"))
	require.Equal(t, "ten_x", h.Get("X-BC-Tenant"))
}

func TestBootstrapIsIdempotent(t *testing.T) {
	t.Parallel()
	url := storetest.NewURL(t)
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "shared", "join-token")
	envFile := filepath.Join(dir, "shared", "root.env")
	r := runner{env: map[string]string{"BETTER_COMPUTE_DATABASE_URL": url}}
	args := []string{"bootstrap", "--join-token-file", tokenFile, "--env-file", envFile}

	first := r.run(t, args...)
	require.Equal(t, 0, first.code, first.stderr)
	require.Contains(t, first.stderr, "root token new")
	require.Contains(t, first.stderr, "wrote "+tokenFile)
	lines := strings.Split(strings.TrimSpace(first.stdout), "\n")
	require.Len(t, lines, 3)
	exports := map[string]string{}
	for _, l := range lines {
		k, v, ok := strings.Cut(strings.TrimPrefix(l, "export "), "=")
		require.True(t, ok, l)
		exports[k] = v
	}
	require.NoError(t, ids.Check(ids.Tenant, exports["BETTER_COMPUTE_TENANT"]))
	require.NoError(t, ids.Check(ids.Pool, exports["BETTER_COMPUTE_POOL"]))
	require.True(t, strings.HasPrefix(exports["BETTER_COMPUTE_TOKEN"], "bct_"))
	joinToken, err := os.ReadFile(tokenFile)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(joinToken), "bcjt_"))
	envContent, err := os.ReadFile(envFile)
	require.NoError(t, err)
	require.Equal(t, first.stdout, string(envContent))
	stTok, err := os.Stat(tokenFile)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), stTok.Mode().Perm(), "the join token is a secret: owner-only")
	stEnv, err := os.Stat(envFile)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), stEnv.Mode().Perm(), "root.env holds the root-admin token: owner-only")

	require.Contains(t, first.stderr, "printed only this once")

	// A re-run reuses everything and does not print the root token again.
	withoutToken := "export BETTER_COMPUTE_TENANT=" + exports["BETTER_COMPUTE_TENANT"] + "\n" +
		"export BETTER_COMPUTE_POOL=" + exports["BETTER_COMPUTE_POOL"] + "\n"
	second := r.run(t, args...)
	require.Equal(t, 0, second.code, second.stderr)
	require.Equal(t, withoutToken, second.stdout, "same tenant and pool, no token")
	require.NotContains(t, second.stdout+second.stderr, exports["BETTER_COMPUTE_TOKEN"])
	require.Contains(t, second.stderr, "root token reused")
	require.Contains(t, second.stderr, "not printed again; it is in "+envFile)
	require.Contains(t, second.stderr, "reused (0 of 1000 uses)")
	require.NotContains(t, second.stderr, "wrote ")
	for path, before := range map[string]os.FileInfo{tokenFile: stTok, envFile: stEnv} {
		after, err := os.Stat(path)
		require.NoError(t, err)
		require.True(t, os.SameFile(before, after), "%s was replaced", path)
		require.Equal(t, before.ModTime(), after.ModTime(), "%s was rewritten", path)
	}
	again, err := os.ReadFile(tokenFile)
	require.NoError(t, err)
	require.Equal(t, joinToken, again)

	db, err := store.Open(t.Context(), url, clock.New(), 10*time.Second, store.Options{})
	require.NoError(t, err)
	t.Cleanup(db.Close)
	for table, want := range map[string]int{"tenants": 1, "api_tokens": 1, "sites": 1, "pools": 1, "join_tokens": 1} {
		var n int
		require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM `+table).Scan(&n))
		require.Equal(t, want, n, table)
	}
	pool, err := store.GetPool(t.Context(), db.Pool, store.AllTenants, exports["BETTER_COMPUTE_POOL"])
	require.NoError(t, err)
	require.Equal(t, "metal-host", pool.Name)
	require.Equal(t, "H100", pool.GPUModel)
	require.EqualValues(t, 8, pool.ExpectGPUCount)
	jt, err := store.GetJoinTokenByHash(t.Context(), db.Pool, iam.HashSecret(strings.TrimSpace(string(joinToken))))
	require.NoError(t, err)
	require.EqualValues(t, 1000, jt.MaxUses)

	// The root token works against the API.
	api := runner{env: map[string]string{"BETTER_COMPUTE_URL": apitest.Start(t, db), "BETTER_COMPUTE_TOKEN": exports["BETTER_COMPUTE_TOKEN"]}}
	res := api.run(t, "pools", "list")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, exports["BETTER_COMPUTE_POOL"])

	// A revoked join token is replaced; the rest is kept.
	_, err = store.RevokeJoinToken(t.Context(), db.Pool, store.AllTenants, jt.ID, db.Now())
	require.NoError(t, err)
	third := r.run(t, args...)
	require.Equal(t, 0, third.code, third.stderr)
	require.Equal(t, withoutToken, third.stdout)
	require.Contains(t, third.stderr, "wrote "+tokenFile)
	require.NotContains(t, third.stderr, "wrote "+envFile)
	replaced, err := os.ReadFile(tokenFile)
	require.NoError(t, err)
	require.NotEqual(t, joinToken, replaced)
}

func TestPKIInit(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "pki")
	r := runner{}
	res := r.run(t, "pki", "init", "--dir", dir, "--trust-domain", "fleet.example", "--gateway-name", "gw.example",
		"--gateway-name", "10.0.0.1", "--joinservice-name", "join.example")
	require.Equal(t, 0, res.code, res.stderr)
	for _, name := range []string{"node-ca.crt", "node-ca.key", "serving-ca.crt", "serving-ca.key", "gateway.crt", "gateway.key",
		"joinservice.crt", "joinservice.key", "trust-domain",
		"join-encryption.key", "join-encryption.pub", "join-signing.key", "join-signing.pub", "command-signing.key", "command-signing.pub", "pins.json"} {
		require.Contains(t, res.stdout, "wrote "+filepath.Join(dir, name))
		require.FileExists(t, filepath.Join(dir, name))
	}
	require.Contains(t, res.stdout, "node-ca.key (private key, mode 0600)")
	require.Contains(t, res.stdout, "join-encryption.key (private key, mode 0600)")
	// The pins (public) are printed, as pins.json holds them.
	pins, err := pki.ReadPins(dir)
	require.NoError(t, err)
	pinLines := "pins (for daemons: --pins-file " + filepath.Join(dir, "pins.json") + ", or one flag each):\n" +
		"  --serving-ca-pin       " + pins.ServingCA + "\n" +
		"  --join-signing-pin     " + pins.JoinSigning + "\n" +
		"  --join-encryption-pin  " + pins.JoinEncryption + "\n" +
		"  --command-signing-pin  " + pins.CommandSigning + "\n"
	require.True(t, strings.HasSuffix(res.stdout, pinLines), "%s", res.stdout)
	require.Contains(t, res.stdout, "trust domain fleet.example")
	require.NotContains(t, res.stdout+res.stderr, "PRIVATE KEY")
	require.NotContains(t, res.stdout+res.stderr, "BEGIN")
	st, err := os.Stat(filepath.Join(dir, "node-ca.key"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	// The certificates name what the flags said.
	gw, err := pki.LoadCert(filepath.Join(dir, pki.GatewayCert))
	require.NoError(t, err)
	require.NoError(t, gw.VerifyHostname("gw.example"))
	require.NoError(t, gw.VerifyHostname("10.0.0.1"))
	js, err := pki.LoadCert(filepath.Join(dir, pki.JoinServiceCert))
	require.NoError(t, err)
	require.NoError(t, js.VerifyHostname("join.example"))
	require.Error(t, js.VerifyHostname("joinservice"), "the flag replaces the default names")

	// Run again: nothing written but the pins file asked for, pins printed.
	pinsOut := filepath.Join(t.TempDir(), "pins.json")
	res = r.run(t, "pki", "init", "--dir", dir, "--pins-out", pinsOut)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "PKI in "+dir+" is complete; nothing written (trust domain fleet.example)\n"+
		"wrote "+pinsOut+"\n"+pinLines, res.stdout)
	copied, err := pki.ReadPinsFile(pinsOut)
	require.NoError(t, err)
	require.Equal(t, pins, copied)
	res = r.run(t, "pki", "init", "--dir", dir, "--pins-out", pinsOut)
	require.Equal(t, 0, res.code, res.stderr)
	require.NotContains(t, res.stdout, "wrote", "an unchanged pins file is not rewritten")
}

// TestPKIExport: `pki export` gives one service, or with --all each
// service in a directory of its own, only the files it reads, and says
// what it wrote; a second run writes nothing; bad flags are refused.
func TestPKIExport(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "pki")
	r := runner{}
	require.Equal(t, 0, r.run(t, "pki", "init", "--dir", dir).code)

	out := filepath.Join(t.TempDir(), "gw")
	res := r.run(t, "pki", "export", "--dir", dir, "--service", "gateway", "--out", out)
	require.Equal(t, 0, res.code, res.stderr)
	files, err := pki.Layout(pki.ServiceGateway)
	require.NoError(t, err)
	var want strings.Builder
	for _, f := range files {
		note := ""
		if pki.IsPrivateKey(f) {
			note = " (private key, mode 0600)"
		}
		fmt.Fprintf(&want, "gateway: wrote %s%s\n", filepath.Join(out, f), note)
	}
	require.Equal(t, want.String(), res.stdout)
	require.NotContains(t, res.stdout+res.stderr, "BEGIN")
	res = r.run(t, "pki", "export", "--dir", dir, "--service", "gateway", "--out", out)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "gateway: "+out+" is up to date\n", res.stdout)

	root := t.TempDir()
	res = r.run(t, "pki", "export", "--dir", dir, "--all", "--out", root)
	require.Equal(t, 0, res.code, res.stderr)
	for _, svc := range pki.Services() {
		files, err := pki.Layout(svc)
		require.NoError(t, err)
		entries, err := os.ReadDir(filepath.Join(root, svc))
		require.NoError(t, err)
		var got []string
		for _, e := range entries {
			got = append(got, e.Name())
		}
		require.Equal(t, files, got, svc)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--service", "gateway"}, "--out is required"},
		{[]string{"--out", out}, "pass --service NAME (or --all)"},
		{[]string{"--all", "--service", "api", "--out", out}, "pass --service NAME or --all, not both"},
		{[]string{"--service", "fakedaemon", "--out", out}, `--service: unknown service "fakedaemon"`},
		{[]string{"--dir", t.TempDir(), "--service", "scheduler", "--out", out}, "pki export: scheduler reads command-signing.key: open "},
	} {
		res := r.run(t, append([]string{"pki", "export", "--dir", dir}, tc.args...)...)
		require.NotEqual(t, 0, res.code, tc.args)
		require.Contains(t, res.stderr, tc.want, tc.args)
	}
}

// migrationVersions returns the versions of the embedded migrations, in
// order.
func migrationVersions(t *testing.T) []string {
	t.Helper()
	entries, err := store.Migrations.ReadDir("migrations")
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		if num, ok := strings.CutSuffix(e.Name(), ".up.sql"); ok {
			num, _, _ = strings.Cut(num, "_")
			out = append(out, strings.TrimLeft(num, "0"))
		}
	}
	require.NotEmpty(t, out)
	return out
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	versions := migrationVersions(t)
	latest, previous := versions[len(versions)-1], "0"
	if len(versions) > 1 {
		previous = versions[len(versions)-2]
	}
	url := storetest.NewURL(t)
	r := runner{env: map[string]string{"BETTER_COMPUTE_DATABASE_URL": url}}
	res := r.run(t, "migrate", "version")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "current: schema version "+latest+" on ")
	require.NotContains(t, res.stdout, ":bc@", "the password is redacted")

	res = r.run(t, "migrate", "down", "--steps", "0")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "--steps must be at least 1")
	res = r.run(t, "migrate", "down", "--all")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "migrated down: schema version 0")
	res = r.run(t, "migrate", "up", "--database-url", url)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "migrated up: schema version "+latest+" on ")
	res = r.run(t, "migrate", "down")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "migrated down: schema version "+previous+" on ", "one step")
	res = r.run(t, "migrate", "up")
	require.Equal(t, 0, res.code, res.stderr)

	res = r.run(t, "migrate", "force", previous)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "forced: schema version "+previous+" on ")
	res = r.run(t, "migrate", "force", latest)
	require.Equal(t, 0, res.code, res.stderr)
	res = r.run(t, "migrate", "force", "twelve")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, `VERSION: want a migration number such as 12, got "twelve"`)
	res = r.run(t, "migrate", "force", "9999")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "9999 is not a migration version")
}

// TestMigrateUpRoles: `migrate up --roles` sets up the services' roles:
// one given a password in the environment logs in with it and has its
// service's privileges only; one given none cannot log in.
func TestMigrateUpRoles(t *testing.T) {
	t.Parallel()
	dbURL := storetest.NewURL(t)
	r := runner{env: map[string]string{"BETTER_COMPUTE_DATABASE_URL": dbURL, "BETTER_COMPUTE_DB_PASSWORD_GATEWAY": "gw-secret"}}
	res := r.run(t, "migrate", "up", "--roles")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "role bc_gateway: privileges of roles.sql, LOGIN with the password of BETTER_COMPUTE_DB_PASSWORD_GATEWAY\n")
	require.Contains(t, res.stdout, "role bc_scheduler: privileges of roles.sql, login unchanged (no BETTER_COMPUTE_DB_PASSWORD_SCHEDULER)\n")
	require.NotContains(t, res.stdout+res.stderr, "gw-secret")

	as := func(user, password string) (*pgx.Conn, error) {
		u, err := url.Parse(dbURL)
		require.NoError(t, err)
		u.User = url.UserPassword(user, password)
		return pgx.Connect(t.Context(), u.String())
	}
	conn, err := as("bc_gateway", "gw-secret")
	require.NoError(t, err)
	defer conn.Close(t.Context())
	_, err = conn.Exec(t.Context(), `SELECT count(*) FROM nodes`)
	require.NoError(t, err)
	_, err = conn.Exec(t.Context(), `UPDATE tenants SET name = name`)
	require.ErrorContains(t, err, "permission denied for table tenants")
	_, err = as("bc_gateway", "wrong")
	require.ErrorContains(t, err, "password authentication failed")
	_, err = as("bc_scheduler", "")
	require.Error(t, err, "bc_scheduler has no login")

	res = r.run(t, "migrate", "up", "--roles")
	require.Equal(t, 0, res.code, "a second run: %s", res.stderr)
}

func TestMiscCommands(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	url := apitest.Start(t, db)
	r := runner{env: map[string]string{"BETTER_COMPUTE_URL": url}}

	res := r.run(t, "healthcheck")
	require.Equal(t, 0, res.code, res.stderr)
	res = r.run(t, "healthcheck", url+"/nope")
	require.Equal(t, 1, res.code)
	require.Empty(t, res.stderr, "service.Healthcheck says why on the process's stderr")

	res = r.run(t, "version")
	require.Equal(t, 0, res.code)
	require.True(t, strings.HasPrefix(res.stdout, "better-compute "), res.stdout)

	for _, shell := range []string{"bash", "zsh", "fish"} {
		res = r.run(t, "completion", shell)
		require.Equal(t, 0, res.code, res.stderr)
		require.Contains(t, res.stdout, "better-compute", shell)
	}
}

// TestUnknownSubcommandFails: a mistyped subcommand is an error (exit 1,
// naming it), not a help page with exit 0; a bare group prints its help.
func TestUnknownSubcommandFails(t *testing.T) {
	t.Parallel()
	r := runner{env: map[string]string{}}
	for _, args := range [][]string{{"nodes", "lst"}, {"completion", "bogus"}, {"bogus"}, {"migrate", "sideways"}} {
		res := r.run(t, args...)
		require.Equal(t, 1, res.code, "%v", args)
		require.Contains(t, res.stderr, `unknown command "`+args[len(args)-1]+`"`, "%v", args)
	}
	res := r.run(t, "nodes")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "list")
}

// TestGetMatchesList: `nodes get` and `commands get` (and `commands run`)
// print a resource with the same field names and values as the element of
// its list -o json, and the fields that get adds are in the list too.
func TestGetMatchesList(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	jsonOf := func(args ...string) any {
		t.Helper()
		res := r.run(t, args...)
		require.Equal(t, 0, res.code, res.stderr)
		var v any
		require.NoError(t, json.Unmarshal([]byte(res.stdout), &v), res.stdout)
		return v
	}
	element := func(list any, id string) map[string]any {
		t.Helper()
		for _, e := range list.([]any) {
			if m := e.(map[string]any); m["id"] == id {
				return m
			}
		}
		t.Fatalf("no %s in %v", id, list)
		return nil
	}

	storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: f.adopted, Serial: "0c1d", NotBefore: f.now,
		NotAfter: f.now.Add(time.Hour), CreatedAt: f.now})
	nodes := jsonOf("nodes", "list", "-o", "json")
	for _, id := range []string{f.adopted, f.failed, f.joining} {
		got := jsonOf("nodes", "get", id).(map[string]any)
		require.Equal(t, element(nodes, id), got, "nodes get %s", id)
	}
	got := jsonOf("nodes", "get", f.adopted).(map[string]any)
	for _, k := range []string{"id", "pool", "state", "reason", "gpus", "model", "gateway", "lastSeen", "reachable", "cordoned",
		"hostname", "certNotAfter", "variant", "bootId", "specGeneration", "observedGeneration", "createdAt", "devices"} {
		require.Contains(t, got, k)
	}
	require.EqualValues(t, 8, got["gpus"])
	devices := got["devices"].([]any)
	require.Len(t, devices, 8)
	require.Equal(t, map[string]any{"index": 3.0, "uuid": "GPU-" + f.adopted + "-3", "model": "NVIDIA H100 80GB HBM3",
		"memoryBytes": 0.0}, devices[3])

	run := jsonOf("commands", "run", "--node", f.adopted, "inventory.refresh", "--request-id", "same-1").(map[string]any)
	id := run["id"].(string)
	require.Equal(t, f.adopted, run["node"])
	cmd := jsonOf("commands", "get", id).(map[string]any)
	require.Equal(t, run, cmd, "commands run and commands get")
	require.Equal(t, element(jsonOf("commands", "list", "-o", "json"), id), cmd, "commands list and commands get")
	for _, k := range []string{"id", "node", "kind", "state", "error", "deliveries", "retrySafe", "requestId", "createdAt",
		"updatedAt", "deadline", "finishedAt", "result"} {
		require.Contains(t, cmd, k)
	}
	require.Nil(t, cmd["result"])

	// A finished command's result is JSON, not a string holding JSON.
	_, err := store.ApplySessionCommandUpdates(t.Context(), f.db.Pool, []store.SessionCommandUpdate{{NodeID: f.adopted,
		CommandID: id, State: "succeeded", Result: []byte(`{"inventory": {"hostname": "h1"}}`), Now: f.db.Now()}})
	require.NoError(t, err)
	cmd = jsonOf("commands", "get", id).(map[string]any)
	require.Equal(t, map[string]any{"inventory": map[string]any{"hostname": "h1"}}, cmd["result"])
	require.NotNil(t, cmd["finishedAt"])
	require.Equal(t, element(jsonOf("commands", "list", "-o", "json"), id), cmd)
}

// TestBadURLNamesTheFlag: an API URL without http:// or https:// (or without
// a host) is refused before any call, naming the flag or the variable it
// came from.
func TestBadURLNamesTheFlag(t *testing.T) {
	t.Parallel()
	r := runner{env: map[string]string{"BETTER_COMPUTE_TOKEN": "bc_x"}}
	res := r.run(t, "--url", "127.0.0.1:3000", "nodes", "list")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: --url: want http://HOST[:PORT] or https://HOST[:PORT], got \"127.0.0.1:3000\"\n", res.stderr)

	r.env["BETTER_COMPUTE_URL"] = "http://"
	res = r.run(t, "events", "watch")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: BETTER_COMPUTE_URL: want http://HOST[:PORT] or https://HOST[:PORT], got \"http://\"\n", res.stderr)
}
