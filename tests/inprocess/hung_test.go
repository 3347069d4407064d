package inprocess_test

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
)

// TestGatewayPausedNodesMove runs two gateways as processes with their
// default timings (heartbeats every 10 s) and six machines spread over both,
// and pauses (SIGSTOP, as `docker pause` does) the gateway holding more
// nodes: it neither dies nor closes a connection, and its kernel goes on
// acknowledging what the machines send. Each of its machines drops its
// session because the gateway was silent for the silence timeout (15 s),
// closes the connection under it and holds a session on the other gateway;
// past the 30 s liveness timeout no node was marked unreachable.
func TestGatewayPausedNodesMove(t *testing.T) {
	ctx := t.Context()
	st, f, names, gws := twoGateways(t, devstack.Options{})

	f.join(t, devstack.JoinOptions{Count: 6, Variant: fakehw.VariantHGXH100}, store.NodeAdopted)
	machines := st.Daemons()

	// sessions: node id → gateway id of the adopted nodes' live sessions.
	sessions := sessionsOf(t, ctx, st.DB.Pool, false)
	victim, survivor, count := busiestGateway(t, waitSessions(t, ctx, st.DB.Pool, false, 6), names)
	var moved []*agent.Machine
	for _, m := range machines {
		st := m.Status()
		require.Equal(t, daemon.StateEstablished, st.State)
		require.Zero(t, st.Silenced)
		if st.GatewayID == victim {
			moved = append(moved, m)
		}
	}
	require.Len(t, moved, count[victim])
	t.Logf("sessions per gateway before the pause: %v; pausing %s", count, victim)

	pausedAt := realClock.Now()
	gws[victim].Pause(t)
	require.Eventually(t, func() bool {
		for _, m := range machines {
			st := m.Status()
			if st.State != daemon.StateEstablished || st.GatewayID != survivor {
				return false
			}
		}
		s := sessions()
		for _, m := range machines {
			if s[m.NodeID()] != survivor {
				return false
			}
		}
		return true
	}, 90*time.Second, 50*time.Millisecond, "every node holds a session on %s", survivor)
	t.Logf("all 6 nodes on %s %s after the pause", survivor, realClock.Now().Sub(pausedAt).Round(time.Millisecond))
	for _, m := range moved {
		require.Equal(t, 1, m.Status().Silenced, "machine %d left %s because it was silent", m.Index(), victim)
	}
	for _, m := range machines {
		if !slices.Contains(moved, m) {
			require.Zero(t, m.Status().Silenced, "machine %d stayed on %s", m.Index(), survivor)
		}
	}

	// Past the liveness timeout (30 s after the pause, when the paused
	// gateway's presence has lapsed): no node was marked unreachable.
	require.NoError(t, clock.Sleep(ctx, realClock, max(pausedAt.Add(40*time.Second).Sub(realClock.Now()), 0)))
	var unreachable int
	require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM events WHERE type = 'node.unreachable'`).Scan(&unreachable))
	require.Zero(t, unreachable, "no node was marked unreachable")
	nodes, err := f.listNodes(ctx)
	require.NoError(t, err)
	require.Len(t, nodes, 6)
	for _, n := range nodes {
		require.True(t, n.GetReachable(), "node %s is reachable", n.GetId())
	}
	gws[victim].Resume(t)
}
