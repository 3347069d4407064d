package cli_test

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestNodesRevoke: `nodes revoke NODE --reason TEXT` revokes the node's
// certificates and says so; `nodes get` then shows revokedAt and
// certNotAfter; a viewer may not revoke and an unknown node is not found.
func TestNodesRevoke(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	notAfter := f.now.Add(24 * time.Hour)
	_, err := f.db.Pool.Exec(t.Context(), `INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, created_at)
		VALUES ('0a1b', $1, '\x00', $2, $3, $2)`, f.adopted, f.now, notAfter)
	require.NoError(t, err)

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
