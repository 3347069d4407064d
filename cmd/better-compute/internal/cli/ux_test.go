package cli_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// TestAPIErrorsNameFlags: a refusal of the API names the flag or argument
// of the command that set the field, and a name's rule is said in words.
func TestAPIErrorsNameFlags(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	res := root.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=8")
	require.Equal(t, 0, res.code, res.stderr)
	long := strings.Repeat("a", 64)
	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"reserve --for", []string{"reserve", "--pool", f.poolID, "--gpus", "1", "--for", "-1h"},
			"error: invalid_argument: --for: must be greater than or equal to 1s and less than or equal to 8784h (366d)\n"},
		{"commands run --timeout", []string{"commands", "run", "--node", f.adopted, "diag.nvml", "--timeout", "48h"},
			"error: invalid_argument: --timeout: must be greater than or equal to 1s and less than or equal to 24h\n"},
		{"reservations list --state", []string{"reservations", "list", "--state", "running"},
			"error: invalid_argument: --state: must be one of pending, binding, active, released, expired or failed\n"},
		{"events watch --types", []string{"events", "watch", "--types", "node.*,Bad"},
			"error: invalid_argument: --types (entry 2): must be an event type such as node.cordoned or a family such as node.*\n"},
		{"pools offer --to empty", []string{"pools", "offer", f.poolID, "--to", "", "--quota", "gpu=1"},
			"error: invalid_argument: --to: must not be empty\n"},
		{"reserve --gpus", []string{"reserve", "--pool", f.poolID, "--gpus", "65", "--for", "1h"},
			"error: invalid_argument: --gpus: must be greater than or equal to 1 and less than or equal to 64\n"},
		{"reserve --request-id", []string{"reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h", "--request-id", "a\u200eb"},
			"error: invalid_argument: --request-id: must not contain control, format or line-separator characters\n"},
		{"pools create NAME", []string{"pools", "create", "Big_Pool", "--site", f.siteID},
			"error: invalid_argument: NAME: must be lowercase letters, digits and '-', starting and ending with a letter or a digit, at most 63 characters\n"},
		{"tenants create NAME too long", []string{"tenants", "create", long},
			"error: invalid_argument: NAME: must be at most 63 characters\n"},
		{"sites create NAME", []string{"sites", "create", "eu-", "--region", "eu"},
			"error: invalid_argument: NAME: must be lowercase letters, digits and '-', starting and ending with a letter or a digit, at most 63 characters\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := root.run(t, tc.args...)
			require.Equal(t, 1, res.code, res.stdout)
			require.Equal(t, tc.stderr, res.stderr)
		})
	}
}

// TestMissingArguments: a command missing its argument names it, with the
// command's usage; an extra one is named too.
func TestMissingArguments(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"nodes", "get"}, "error: missing NODE_ID (usage: better-compute nodes get NODE_ID [flags])\n"},
		{[]string{"nodes", "cordon", "--reason", "x"}, "error: missing NODE_ID (usage: better-compute nodes cordon NODE_ID --reason TEXT [flags])\n"},
		{[]string{"release"}, "error: missing RESERVATION_ID (usage: better-compute release RESERVATION_ID [flags])\n"},
		{[]string{"pools", "offer", "--to", "t", "--quota", "gpu=1"},
			"error: missing POOL_ID (usage: better-compute pools offer POOL_ID --to TENANT_ID --quota gpu=N [flags])\n"},
		{[]string{"tenants", "create"}, "error: missing NAME (usage: better-compute tenants create NAME [--parent TENANT_ID] [flags])\n"},
		{[]string{"nodes", "get", "a", "b", "c"}, "error: unexpected arguments \"b\" \"c\" (usage: better-compute nodes get NODE_ID [flags])\n"},
	} {
		res := runner{env: map[string]string{}}.run(t, tc.args...)
		require.Equal(t, 1, res.code, "%v", tc.args)
		require.Equal(t, tc.stderr, res.stderr, "%v", tc.args)
	}
}

// completions runs `__complete args…` and returns the candidates (without
// descriptions) and the directive line.
func completions(t *testing.T, r runner, args ...string) ([]string, string) {
	t.Helper()
	res := r.run(t, append([]string{"__complete"}, args...)...)
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	var out []string
	for _, l := range lines[:len(lines)-1] {
		id, _, _ := strings.Cut(l, "\t")
		out = append(out, id)
	}
	return out, lines[len(lines)-1]
}

// TestIDCompletion: node, pool and reservation ids complete, as arguments
// and as flags' values, from the API at the configured URL with the
// configured token; an unreachable API completes nothing, quietly, and
// never files.
func TestIDCompletion(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	res := root.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=8")
	require.Equal(t, 0, res.code, res.stderr)
	open := f.reserveOne(t, root)
	released := f.reserveOne(t, root)
	res = root.run(t, "release", released)
	require.Equal(t, 0, res.code, res.stderr)

	nodes := []string{f.adopted, f.failed, f.joining}
	for _, args := range [][]string{
		{"nodes", "get", ""}, {"nodes", "cordon", "--reason", "x", ""}, {"nodes", "revoke", ""}, {"nodes", "uncordon", ""},
		{"commands", "run", "--node", ""}, {"commands", "list", "--node", ""},
	} {
		got, directive := completions(t, root, args...)
		require.ElementsMatch(t, nodes, got, "%v", args)
		require.Equal(t, ":4", directive, "%v", args)
	}
	got, _ := completions(t, root, "nodes", "get", strings.ToLower(f.adopted[:len(f.adopted)-2]))
	require.Subset(t, nodes, got)
	require.Contains(t, got, f.adopted)
	got, directive := completions(t, root, "nodes", "get", f.adopted, "")
	require.Empty(t, got, "one argument only")
	require.Equal(t, ":4", directive)

	for _, args := range [][]string{
		{"reserve", "--pool", ""}, {"pools", "offer", "--to", "x", "--quota", "gpu=1", ""}, {"pools", "offers", "--pool", ""}, {"nodes", "list", "--pool", ""},
		{"reservations", "list", "--pool", ""}, {"join-tokens", "create", "--pool", ""},
	} {
		got, directive := completions(t, root, args...)
		require.Equal(t, []string{f.poolID}, got, "%v", args)
		require.Equal(t, ":4", directive, "%v", args)
	}

	got, _ = completions(t, root, "release", "")
	require.Equal(t, []string{open}, got, "only reservations that have not ended")
	got, _ = completions(t, root, "ssh-proxy", "--node", f.adopted, "--reservation", "")
	require.Equal(t, []string{open}, got)
	got, _ = completions(t, root, "reservations", "get", "")
	require.ElementsMatch(t, []string{open, released}, got)

	down := runner{env: map[string]string{"BETTER_COMPUTE_URL": "http://127.0.0.1:1", "BETTER_COMPUTE_TOKEN": f.root}}
	for _, args := range [][]string{{"nodes", "get", ""}, {"reserve", "--pool", ""}, {"release", ""}} {
		got, directive := completions(t, down, args...)
		require.Empty(t, got, "%v", args)
		require.Equal(t, ":4", directive, "%v", args)
	}
}

// TestReserveFailedExitsNonZero: a reservation no node can hold is failed
// at once: reserve exits 1 with the reason, with or without --wait.
func TestReserveFailedExitsNonZero(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "9", "--for", "1h")
	require.Equal(t, 1, res.code)
	failed := parseReservation(t, res.stdout)
	require.Equal(t, "failed", failed.State)
	require.Equal(t, "error: reservation "+failed.ID+" is failed: no node of pool "+f.poolID+" has 9 GPUs (largest: 8)\n", res.stderr)
}

// TestTokenTTLForms: tokens create --ttl takes Go durations, days (7d) and
// plain seconds.
func TestTokenTTLForms(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	want := map[string]time.Duration{"90m": 90 * time.Minute, "7d": 7 * 24 * time.Hour, "1d12h": 36 * time.Hour,
		"3600": time.Hour}
	for ttl := range want {
		res := r.run(t, "tokens", "create", "--name", "ttl-"+ttl, "--role", "viewer", "--ttl", ttl)
		require.Equal(t, 0, res.code, "--ttl %s: %s", ttl, res.stderr)
	}
	res := r.run(t, "tokens", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var tokens []struct {
		Name      string     `json:"name"`
		CreatedAt time.Time  `json:"createdAt"`
		ExpiresAt *time.Time `json:"expiresAt"`
	}
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &tokens), res.stdout)
	seen := 0
	for _, tok := range tokens {
		ttl, ok := strings.CutPrefix(tok.Name, "ttl-")
		if !ok {
			continue
		}
		seen++
		require.NotNil(t, tok.ExpiresAt, ttl)
		require.InDelta(t, want[ttl].Seconds(), tok.ExpiresAt.Sub(tok.CreatedAt).Seconds(), 1, ttl)
	}
	require.Equal(t, len(want), seen)

	for ttl, stderr := range map[string]string{
		"7x":    "error: invalid argument \"7x\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute tokens create --help')\n",
		"367d":  "error: --ttl must be at most 8784h (366 days), got 8808h0m0s\n",
		"1.5":   "error: invalid argument \"1.5\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute tokens create --help')\n",
		"d":     "error: invalid argument \"d\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute tokens create --help')\n",
		"1d-1h": "error: invalid argument \"1d-1h\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute tokens create --help')\n",
	} {
		res := r.run(t, "tokens", "create", "--name", "bad", "--role", "viewer", "--ttl", ttl)
		require.Equal(t, 1, res.code, ttl)
		require.Equal(t, stderr, res.stderr, ttl)
	}
}

// TestTunnelHintsNameReservationFlag: refused a shell (a tenant-member
// has no nodes.access), console and ssh-proxy name --reservation, the flag
// that reaches a reservation's sandbox, not the API's field.
func TestTunnelHintsNameReservationFlag(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	now := db.Now()
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	url := apitest.StartWith(t, db, api.Config{PKI: service.PKI{PKIDir: dir}})
	tenant := apitest.Tenant(t, db, "acme")
	node := storetest.Node(t, db, &storetest.NodeOpts{PoolID: storetest.Pool(t, db, &storetest.PoolOpts{OwnerTenantID: tenant}).ID,
		GPUs: 8, State: store.NodeAdopted, Reachable: true, LastSeen: now}).ID
	member := runner{env: map[string]string{"BETTER_COMPUTE_URL": url,
		"BETTER_COMPUTE_TOKEN": apitest.Token(t, db, tenant, iam.RoleTenantMember)}}
	res := member.run(t, "console", "--node", node)
	require.Equal(t, 255, res.code)
	require.Equal(t, "error: permission_denied: role tenant-member may not open a shell or break-glass SSH on a node "+
		"(needs nodes.access); ssh-cert and ssh-proxy take --reservation RES_ID for the sandbox of a reservation\n", res.stderr)
	res = member.run(t, "ssh-proxy", "--node", node)
	require.Equal(t, 255, res.code)
	require.Equal(t, "ssh-proxy: permission_denied: role tenant-member may not open a shell or break-glass SSH on a node "+
		"(needs nodes.access); pass --reservation for the sandbox of a reservation\n", res.stderr)
}

// TestShowIsGet: every get subcommand (nodes, commands, reservations) is
// also show: the same output, help listing it under Aliases, and the group
// completing it, described as the alias; show's argument completes as
// get's does.
func TestShowIsGet(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	res := root.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=8")
	require.Equal(t, 0, res.code, res.stderr)
	reservation := f.reserveOne(t, root)
	res = root.run(t, "commands", "run", "--node", f.adopted, "inventory.refresh")
	require.Equal(t, 0, res.code, res.stderr)
	var command struct{ ID string }
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &command))

	var groups []string
	for _, g := range cli.NewRoot(cli.Env{Getenv: func(string) string { return "" }}).Commands() {
		if get, _, err := g.Find([]string{"get"}); err == nil && get != g {
			groups = append(groups, g.Name())
			require.Equal(t, []string{"show"}, get.Aliases, g.Name())
		}
	}
	require.ElementsMatch(t, []string{"nodes", "commands", "reservations"}, groups)

	for group, id := range map[string]string{"nodes": f.adopted, "commands": command.ID, "reservations": reservation} {
		get := root.run(t, group, "get", id)
		require.Equal(t, 0, get.code, get.stderr)
		show := root.run(t, group, "show", id)
		require.Equal(t, 0, show.code, show.stderr)
		require.Equal(t, get.stdout, show.stdout, group)
		require.Contains(t, show.stdout, id)

		help := root.run(t, group, "show", "--help")
		require.Equal(t, 0, help.code, help.stderr)
		require.Contains(t, help.stdout, "Aliases:\n  get, show\n", group)

		res := root.run(t, "__complete", group, "sh")
		require.Equal(t, 0, res.code, res.stderr)
		require.Contains(t, res.stdout, "show\talias of get: ", group)
		got, _ := completions(t, root, group, "")
		require.Contains(t, got, "get", group)
		require.Contains(t, got, "show", group)
	}
	got, directive := completions(t, root, "reservations", "show", "")
	require.Equal(t, []string{reservation}, got)
	require.Equal(t, ":4", directive)
	got, _ = completions(t, root, "nodes", "show", "")
	require.ElementsMatch(t, []string{f.adopted, f.failed, f.joining}, got)
}

// TestJoinTokenTTLForms: join-tokens create --ttl takes the forms of tokens
// create --ttl (Go durations, days, plain seconds), with the same errors.
func TestJoinTokenTTLForms(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	for _, tc := range []struct {
		ttl  string
		want time.Duration
	}{
		{"90m", 90 * time.Minute}, {"7d", 7 * 24 * time.Hour}, {"1d12h", 36 * time.Hour}, {"3600", time.Hour},
		{"30d", 720 * time.Hour},
	} {
		t.Run(tc.ttl, func(t *testing.T) {
			res := r.run(t, "join-tokens", "create", "--pool", f.poolID, "--ttl", tc.ttl)
			require.Equal(t, 0, res.code, res.stderr)
			jt, err := store.GetJoinTokenByHash(t.Context(), f.db.Pool, iam.HashSecret(strings.TrimSpace(res.stdout)))
			require.NoError(t, err)
			require.InDelta(t, tc.want.Seconds(), jt.ExpiresAt.Sub(jt.CreatedAt).Seconds(), 1)
		})
	}
	for _, tc := range []struct{ ttl, stderr string }{
		{"7x", "error: invalid argument \"7x\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute join-tokens create --help')\n"},
		{"1d-1h", "error: invalid argument \"1d-1h\" for \"--ttl\" flag: want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute join-tokens create --help')\n"},
		{"31d", "error: --ttl must be at most 720h (30 days), got 744h0m0s\n"},
		{"0", "error: --ttl must be positive (1s to 720h (30 days)), got 0s\n"},
	} {
		t.Run(tc.ttl, func(t *testing.T) {
			res := r.run(t, "join-tokens", "create", "--pool", f.poolID, "--ttl", tc.ttl)
			require.Equal(t, 1, res.code)
			require.Empty(t, res.stdout)
			require.Equal(t, tc.stderr, res.stderr)
		})
	}
}

// TestFlagCompletion: -o, --state and --types complete their values with
// no call; --types completes the entry after the last comma, keeping those
// before it, with no space after; --tenant, --to and --parent complete the
// tenant ids the caller sees, with their names, and nothing when the API
// cannot be asked.
func TestFlagCompletion(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	res := root.run(t, "tenants", "create", "acme")
	require.Equal(t, 0, res.code, res.stderr)
	acme := strings.TrimSpace(res.stdout)
	none := runner{env: map[string]string{}}

	for _, args := range [][]string{{"nodes", "list", "-o", ""}, {"reservations", "list", "--output", ""}, {"ssh-cert", "-o", ""}} {
		got, directive := completions(t, none, args...)
		require.Equal(t, []string{"table", "json"}, got, "%v", args)
		require.Equal(t, ":4", directive, "%v", args)
	}
	got, directive := completions(t, none, "reservations", "list", "--state", "")
	require.Equal(t, []string{"pending", "binding", "active", "released", "expired", "failed"}, got)
	require.Equal(t, ":4", directive)

	got, directive = completions(t, none, "events", "watch", "--types", "")
	require.Contains(t, got, "node.*")
	require.Contains(t, got, "reservation.released")
	require.Equal(t, ":6", directive, "no file, no space")
	got, directive = completions(t, none, "events", "watch", "--types", "node.*,reservation.re")
	require.Equal(t, []string{"node.*,reservation.released"}, got)
	require.Equal(t, ":6", directive)
	got, _ = completions(t, none, "events", "watch", "--types", "node.*,node")
	require.NotContains(t, got, "node.*,node.*", "an entry given is not offered again")
	require.Contains(t, got, "node.*,node.cordoned")

	for _, args := range [][]string{
		{"usage", "--tenant", ""}, {"tokens", "create", "--tenant", ""}, {"tokens", "list", "--tenant", ""},
		{"pools", "offer", f.poolID, "--to", ""}, {"tenants", "create", "x", "--parent", ""},
	} {
		got, directive := completions(t, root, args...)
		require.ElementsMatch(t, []string{f.tenant, acme}, got, "%v", args)
		require.Equal(t, ":4", directive, "%v", args)
	}
	res = root.run(t, "__complete", "usage", "--tenant", "")
	require.Contains(t, res.stdout, acme+"\tacme\n")
	got, directive = completions(t, runner{env: map[string]string{"BETTER_COMPUTE_URL": "http://127.0.0.1:1", "BETTER_COMPUTE_TOKEN": f.root}},
		"pools", "offer", f.poolID, "--to", "")
	require.Empty(t, got)
	require.Equal(t, ":4", directive)
}

// TestDevErrorsAreLikeOthers: dev's refusals print "error: <message>",
// lower-case, exit 1, as every command's do (Run's FormatError; cobra's own
// "Error:" is silenced).
func TestDevErrorsAreLikeOthers(t *testing.T) {
	t.Parallel()
	r := runner{env: map[string]string{}}
	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"memory and data", []string{"dev", "--memory", "--data", "x"},
			"error: --memory and --data cannot be used together: --memory keeps no data\n"},
		{"bad flag", []string{"dev", "--port", "abc"},
			"error: invalid argument \"abc\" for \"--port\" flag: strconv.ParseInt: parsing \"abc\": invalid syntax (see 'better-compute dev --help')\n"},
		{"unknown flag", []string{"dev", "--bogus"}, "error: unknown flag: --bogus (see 'better-compute dev --help')\n"},
		{"argument", []string{"dev", "extra"}, "error: unknown command \"extra\" for \"better-compute dev\"\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := r.run(t, tc.args...)
			require.Equal(t, 1, res.code)
			require.Empty(t, res.stdout)
			require.Equal(t, tc.stderr, res.stderr)
		})
	}
}

// TestLifetimeFlagsHelpShowsOneDefault: a lifetime flag whose default is
// none says so in its own words, without pflag's "(default 0s)" beside it.
func TestLifetimeFlagsHelpShowsOneDefault(t *testing.T) {
	t.Parallel()
	res := runner{}.run(t, "tokens", "create", "--help")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "(default: it never expires)")
	require.NotContains(t, res.stdout, "(default 0s)")
}
