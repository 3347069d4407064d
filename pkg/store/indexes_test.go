package store_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// joinPathIndexes are the indexes of the tables a machine's join, session
// and adoption write, each with what reads through it: every row written
// there writes an entry in each (an update, unless heap-only), so an index
// that nothing reads is a cost of every join. TestJoinPathIndexes keeps the
// list equal to the schema: a new index on these tables is added here with
// its reader.
var joinPathIndexes = map[string]map[string]string{
	"nodes": {
		"nodes_pkey":             "every read and write of a node",
		"nodes_join_key":         "JoinedKeys: one key joins as one node (unique)",
		"nodes_pool_id_idx":      "ListNodes by pool, the scheduler's reads of a pool (placement.go)",
		"nodes_provisioning_idx": "the acceptance reconciler's joining and accepting nodes (AnyAcceptanceWork, ClaimJoiningNodes, ExpireJoiningNodes)",
	},
	"node_certs": {
		"node_certs_pkey":          "a session's client certificate by serial (OpenSessions, GetSessionCert)",
		"node_certs_node_id_idx":   "a node's certificates: renewals, revocation, its newest (LastNodeCertCreatedAt), deleting a node",
		"node_certs_not_after_idx": "retention of expired certificates",
	},
	"node_devices": {
		"node_devices_pkey": "a node's devices, bookings' device indexes",
	},
	"commands": {
		"commands_pkey":              "every command by id",
		"commands_node_request_idx":  "RunCommand's request id, once per node (unique)",
		"commands_open_idx":          "a node's open commands: deliveries, pending work, acceptance",
		"commands_open_deadline_idx": "the expiry of users' open commands",
	},
	"events": {
		"events_pkey":       "events by id",
		"events_tenant_idx": "the watch: a tenant's events in id order",
	},
	"outbox": {
		"outbox_pkey": "the relay, in id order",
	},
}

// TestJoinPathIndexes: the join path's tables have exactly the indexes of
// joinPathIndexes.
func TestJoinPathIndexes(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	for table, want := range joinPathIndexes {
		rows, err := db.Pool.Query(t.Context(), `SELECT indexrelid::regclass::text FROM pg_index
			WHERE indrelid = $1::regclass ORDER BY 1`, table)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		var names []string
		for name := range want {
			names = append(names, name)
		}
		require.ElementsMatch(t, names, got, "indexes of %s", table)
	}
}
