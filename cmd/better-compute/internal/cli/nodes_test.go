package cli_test

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestNodesRevoke: `nodes revoke NODE --reason TEXT` revokes the node's
// certificates and says so; `nodes get` then shows revokedAt and
// certNotAfter; a viewer may not revoke and an unknown node is not found.
func TestNodesRevoke(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	notAfter := f.now.Add(24 * time.Hour)
	storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: f.adopted, Serial: "0a1b", NotBefore: f.now, NotAfter: notAfter,
		CreatedAt: f.now})

	res := f.runner(f.viewer).run(t, "nodes", "revoke", f.adopted)
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: permission_denied: role viewer may not call RevokeNode (needs fleet.manage)\n", res.stderr)

	res = f.runner(f.root).run(t, "nodes", "revoke", "node_nope")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: not_found: node node_nope not found\n", res.stderr)

	res = f.runner(f.root).run(t, "nodes", "revoke", f.adopted, "--reason", "disk stolen")
	require.Equal(t, 0, res.code, res.stderr)
	require.Regexp(t, regexp.MustCompile(`^revoked `+f.adopted+` at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(1 certificate\(s\) revoked now\)\n$`), res.stdout)

	res = f.runner(f.root).run(t, "nodes", "revoke", f.adopted)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "(0 certificate(s) revoked now)")

	res = f.runner(f.viewer).run(t, "nodes", "get", f.adopted)
	require.Equal(t, 0, res.code, res.stderr)
	var node map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &node), res.stdout)
	require.Contains(t, node, "revokedAt")
	got, err := time.Parse(time.RFC3339, node["certNotAfter"].(string))
	require.NoError(t, err)
	require.True(t, got.Equal(notAfter), "%v", node["certNotAfter"])

	res = f.runner(f.viewer).run(t, "nodes", "get", f.failed)
	require.Equal(t, 0, res.code, res.stderr)
	require.NotContains(t, res.stdout, "revokedAt")

	// nodes list marks the revoked node, and only it.
	res = f.runner(f.viewer).run(t, "nodes", "list")
	require.Equal(t, 0, res.code, res.stderr)
	for line := range strings.Lines(res.stdout) {
		fields := strings.Fields(line)
		switch fields[0] {
		case f.adopted:
			require.Equal(t, "adopted,revoked", fields[2], line)
		case "ID":
		default:
			require.NotContains(t, fields[2], "revoked", line)
		}
	}
}

// TestNodesCordon: `nodes cordon NODE --reason TEXT` cordons the node (list
// shows it with the reason, JSON has cordonReason), a viewer may not, the
// reason is required and validated; `nodes uncordon` undoes it; each change
// writes its event.
func TestNodesCordon(t *testing.T) {
	t.Parallel()
	f := newFleet(t)

	res := f.runner(f.viewer).run(t, "nodes", "cordon", f.adopted, "--reason", "x")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: permission_denied: role viewer may not call CordonNode (needs fleet.manage)\n", res.stderr)
	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted)
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, `"reason" not set`)
	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted, "--reason", "   ")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: invalid_argument: --reason: must not be empty or only spaces\n", res.stderr)
	res = f.runner(f.root).run(t, "nodes", "cordon", "node_nope", "--reason", "x")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: not_found: node node_nope not found\n", res.stderr)

	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted, "--reason", "fan noise")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "cordoned "+f.adopted+": fan noise\n", res.stdout)
	// Cordoning it again says it was cordoned; the same reason changes
	// nothing (no event), a new one replaces it (one event).
	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted, "--reason", "fan noise")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, f.adopted+" was already cordoned with this reason; nothing changed: fan noise\n", res.stdout)
	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted, "--reason", "fan replaced tomorrow")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, f.adopted+" was already cordoned (reason: fan noise); reason now: fan replaced tomorrow\n", res.stdout)
	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted, "--reason", "fan noise")
	require.Equal(t, 0, res.code, res.stderr)

	res = f.runner(f.viewer).run(t, "nodes", "list")
	require.Equal(t, 0, res.code, res.stderr)
	seen := false
	for line := range strings.Lines(res.stdout) {
		fields := strings.Fields(line)
		switch fields[0] {
		case f.adopted:
			seen = true
			require.Equal(t, "adopted,cordoned", fields[2], line)
			require.True(t, strings.HasSuffix(strings.TrimSpace(line), "fan noise"), line)
		case "ID":
		default:
			require.NotContains(t, fields[2], "cordoned", line)
		}
	}
	require.True(t, seen, res.stdout)
	res = f.runner(f.viewer).run(t, "nodes", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, `"cordonReason": "fan noise"`)

	res = f.runner(f.root).run(t, "nodes", "uncordon", f.adopted)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "uncordoned "+f.adopted+"\n", res.stdout)
	res = f.runner(f.root).run(t, "nodes", "uncordon", f.adopted)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, f.adopted+" was not cordoned; nothing changed\n", res.stdout)
	res = f.runner(f.viewer).run(t, "nodes", "list")
	require.Equal(t, 0, res.code, res.stderr)
	require.NotContains(t, res.stdout, "cordoned")

	var types []string
	rows, err := f.db.Pool.Query(t.Context(), `SELECT type FROM events WHERE subject_id = $1 ORDER BY id`, f.adopted)
	require.NoError(t, err)
	for rows.Next() {
		var typ string
		require.NoError(t, rows.Scan(&typ))
		types = append(types, typ)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"node.cordoned", "node.cordoned", "node.cordoned", "node.uncordoned"}, types)

	// A revoked node is not cordoned.
	res = f.runner(f.root).run(t, "nodes", "revoke", f.adopted)
	require.Equal(t, 0, res.code, res.stderr)
	res = f.runner(f.root).run(t, "nodes", "cordon", f.adopted, "--reason", "x")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: failed_precondition: node "+f.adopted+" is revoked\n", res.stderr)
}
