package inprocess_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/tests/internal/procs"
)

// liveSessions returns node id → gateway id of the adopted nodes that hold a
// live session; settled keeps only those that have also applied their
// NodeSpec (observed = desired generation).
func liveSessions(ctx context.Context, pool *pgxpool.Pool, settled bool) (map[string]string, error) {
	rows, err := pool.Query(ctx, `SELECT id, gateway_id FROM nodes
		WHERE provision_state = 'adopted' AND session_id IS NOT NULL
			AND (NOT $1 OR observed_generation = spec_generation)`, settled)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var id, gw string
		if err := rows.Scan(&id, &gw); err != nil {
			return nil, err
		}
		out[id] = gw
	}
	return out, rows.Err()
}

// sessionsOf returns a reader of liveSessions for Eventually conditions: a
// failed read is logged and reads as no session.
func sessionsOf(t *testing.T, ctx context.Context, pool *pgxpool.Pool, settled bool) func() map[string]string {
	return func() map[string]string {
		out, err := liveSessions(ctx, pool, settled)
		if err != nil {
			t.Logf("read the sessions: %v", err)
		}
		return out
	}
}

// waitSessions waits until n nodes hold live sessions (liveSessions) and
// returns them.
func waitSessions(t *testing.T, ctx context.Context, pool *pgxpool.Pool, settled bool, n int) map[string]string {
	t.Helper()
	var s map[string]string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var err error
		s, err = liveSessions(ctx, pool, settled)
		require.NoError(c, err)
		require.Len(c, s, n)
	}, 90*time.Second, 100*time.Millisecond, "%d machines adopted with live sessions", n)
	return s
}

// busiestGateway returns which of the two gateways holds more of sessions
// (node id → gateway id), the other, and the sessions per gateway; it fails
// t when the busier one holds none.
func busiestGateway(t *testing.T, sessions map[string]string, names []string) (victim, survivor string, count map[string]int) {
	t.Helper()
	count = map[string]int{}
	for _, gw := range sessions {
		count[gw]++
	}
	victim, survivor = names[0], names[1]
	if count[names[1]] > count[names[0]] {
		victim, survivor = names[1], names[0]
	}
	require.Positive(t, count[victim], "sessions per gateway: %v", count)
	return victim, survivor, count
}

// twoGateways starts the control plane in process (setupWith opts, with the
// gateway URLs filled in) with two gateway processes outside it on the
// stack's database, NATS and PKI, gw-a and gw-b (gatewayEnv added to their
// environment), and returns the stack, its fixture, the gateways' names and
// their processes.
func twoGateways(t *testing.T, opts devstack.Options, gatewayEnv ...string) (*devstack.Stack, *fixture, []string, map[string]*procs.Proc) {
	t.Helper()
	addrs := []string{procs.FreeAddr(t), procs.FreeAddr(t)}
	names := []string{"gw-a", "gw-b"}
	opts.ExternalGatewayURL = "https://" + addrs[0] + "," + "https://" + addrs[1]
	f := setupWith(t, opts)
	st := f.stack
	gws := map[string]*procs.Proc{}
	for i, name := range names {
		health := procs.FreeAddr(t)
		env := append([]string{"BETTER_COMPUTE_HEALTH_LISTEN=" + health,
			"BETTER_COMPUTE_DATABASE_URL=" + st.DatabaseURL, "BETTER_COMPUTE_NATS_URL=" + st.NATSURL, "BETTER_COMPUTE_PKI_DIR=" + st.PKIDir,
			"BETTER_COMPUTE_LISTEN=" + addrs[i], "BETTER_COMPUTE_GATEWAY_ID=" + name,
			"BETTER_COMPUTE_GATEWAY_JOINSERVICE_URL=" + st.JoinServiceControlURL}, gatewayEnv...)
		gws[name] = procs.Start(t, "gateway", health, append(env, "BETTER_COMPUTE_LOG_LEVEL=warn")...)
	}
	return st, f, names, gws
}
