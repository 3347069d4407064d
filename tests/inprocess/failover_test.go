package inprocess_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

// failoverWithin is how soon the nodes of a killed gateway must hold a
// session on the other one (within 10 s).
const failoverWithin = 10 * time.Second

// TestGatewayKilledMidRun runs two gateways as processes and eight machines
// spread over both, keeps commands flowing to every node, and kills (SIGKILL)
// the gateway holding more nodes while a node.reboot runs on it. The killed
// gateway's nodes hold a session on the other within 10 s; commands queued
// while they were away and commands after are delivered by pokes that follow
// the node to its new gateway (the gateways' periodic re-read is set to an
// hour, so nothing else would deliver them); every command succeeds and ran
// exactly once (the machines count what their hardware ran), the reboot
// rebooted its machine once; no node was marked unreachable; reservations
// active before the kill stay active, and the NodeSpecs of reservations made
// after it are delivered through the surviving gateway and observed (I3).
func TestGatewayKilledMidRun(t *testing.T) {
	ctx := t.Context()
	st, f, names, gws := twoGateways(t, devstack.Options{SignedIntent: true}, "BETTER_COMPUTE_GATEWAY_RESYNC=1h")
	commands := computev1connect.NewCommandServiceClient(http.DefaultClient, st.APIURL+"/api/compute", st.ClientOptions()...)

	// Eight machines; commands take a little while so that some are in
	// flight when the gateway dies; the reboot takes 3 s.
	durations := fakehw.DefaultDurations()
	for _, k := range []string{fakehw.KindDiagNVML, fakehw.KindInventoryRefresh, fakehw.KindLogsCollect} {
		durations.ByKind[k] = 300 * time.Millisecond
	}
	durations.ByKind[fakehw.KindNodeReboot] = 3 * time.Second
	f.join(t, devstack.JoinOptions{Count: 8, Variant: fakehw.VariantHGXH100, Configure: func(c *fakedaemon.Config) {
		c.Durations = &durations
		c.Core = daemon.Config{RebootDowntime: time.Second}
	}}, store.NodeAdopted)
	machines := st.Daemons()

	// sessions: node id → gateway id of the live sessions of the nodes
	// that applied their NodeSpec.
	sessions := sessionsOf(t, ctx, st.DB.Pool, true)
	before8 := waitSessions(t, ctx, st.DB.Pool, true, 8)
	victim, survivor, count := busiestGateway(t, before8, names)
	t.Logf("sessions per gateway before the kill: %v; killing %s", count, victim)
	machineOf := map[string]*agent.Machine{}
	var victimNodes []string
	for id, gw := range before8 {
		if gw == victim {
			victimNodes = append(victimNodes, id)
		}
	}
	for _, m := range machines {
		machineOf[m.Status().NodeID] = m
	}
	// The load goes to every node but the one that reboots (commands
	// queued after the reboot would wait until its machine is back).
	rebootNode := victimNodes[0]
	nodeIDs := make([]string, 0, 8)
	for id := range machineOf {
		if id != rebootNode {
			nodeIDs = append(nodeIDs, id)
		}
	}

	// Reservations placed before the kill (some on the victim's nodes).
	tenant := f.offer(t, "failover", 64)
	var before []string
	for range 8 {
		before = append(before, f.reserve(t, tenant, 4, time.Hour).ID)
	}
	for _, id := range before {
		f.waitState(t, id, store.ReservationActive, activeWithin)
	}

	run := func(node, kind string) (string, error) {
		res, err := commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{
			NodeId: node, Kind: kind, Timeout: durationpb.New(2 * time.Minute)}))
		if err != nil {
			return "", err
		}
		return res.Msg.GetCommand().GetId(), nil
	}
	// Commands flow to those nodes, one every 20 ms, until stopped.
	var (
		mu      sync.Mutex
		ids     []string
		loadErr error
	)
	loadCtx, stopLoad := context.WithCancel(ctx)
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		kinds := []string{fakehw.KindDiagNVML, fakehw.KindInventoryRefresh, fakehw.KindLogsCollect}
		tick := realClock.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-loadCtx.Done():
				return
			case <-tick.C():
			}
			id, err := run(nodeIDs[i%len(nodeIDs)], kinds[i%len(kinds)])
			mu.Lock()
			if err != nil {
				loadErr = err
				mu.Unlock()
				return
			}
			ids = append(ids, id)
			mu.Unlock()
		}
	}()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			stopLoad()
			<-loadDone
		}
	}
	t.Cleanup(stop)

	// A reboot runs on one of the victim's nodes when the gateway dies.
	rebooted := machineOf[rebootNode]
	boot0 := rebooted.Status().BootID
	reboot, err := run(rebootNode, fakehw.KindNodeReboot)
	require.NoError(t, err)
	require.NoError(t, clock.Sleep(ctx, realClock, time.Second))

	killedAt := realClock.Now()
	gws[victim].Kill()
	require.Eventually(t, func() bool {
		s := sessions()
		for id := range machineOf {
			if s[id] != survivor || machineOf[id].Status().State != daemon.StateEstablished {
				return false
			}
		}
		return true
	}, failoverWithin, 20*time.Millisecond, "every node holds a session on %s within %s of the kill", survivor, failoverWithin)
	t.Logf("all 8 nodes on %s %s after the kill", survivor, realClock.Now().Sub(killedAt).Round(time.Millisecond))

	// Reservations made after the kill: their NodeSpecs go out through the
	// survivor and are observed.
	var after []string
	for range 8 {
		after = append(after, f.reserve(t, tenant, 4, time.Hour).ID)
	}
	require.NoError(t, clock.Sleep(ctx, realClock, 2*time.Second))
	stop()
	mu.Lock()
	require.NoError(t, loadErr)
	issued := append([]string{reboot}, ids...)
	mu.Unlock()
	var beforeKill, afterKill int
	require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE created_at < $2), count(*) FILTER (WHERE created_at > $2)
		FROM commands WHERE id = ANY($1)`, issued, killedAt).Scan(&beforeKill, &afterKill))
	require.Positive(t, beforeKill, "commands issued before the kill")
	require.Positive(t, afterKill, "commands issued after the kill")

	for _, id := range after {
		f.waitState(t, id, store.ReservationActive, activeWithin)
	}
	for _, id := range before {
		require.Equal(t, store.ReservationActive, f.reservation(t, id).State, "a reservation active before the kill stays active (I5)")
	}
	require.Eventually(t, func() bool { return len(sessions()) == 8 }, 30*time.Second, 50*time.Millisecond,
		"every node observed its current NodeSpec generation (I3)")

	// Every command succeeds, and ran once.
	var open int
	require.Eventually(t, func() bool {
		require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM commands
			WHERE id = ANY($1) AND state NOT IN ('succeeded', 'failed', 'expired')`, issued).Scan(&open))
		return open == 0
	}, 60*time.Second, 100*time.Millisecond, "every command finishes: %d open", &open)
	rows, err := st.DB.Pool.Query(ctx, `SELECT id, state, coalesce(error, '') FROM commands
		WHERE id = ANY($1) AND state <> 'succeeded'`, issued)
	require.NoError(t, err)
	type bad struct{ id, state, err string }
	var notSucceeded []bad
	for rows.Next() {
		var b bad
		require.NoError(t, rows.Scan(&b.id, &b.state, &b.err))
		notSucceeded = append(notSucceeded, b)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, notSucceeded, "commands that did not succeed")
	var succeeded int
	require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM commands WHERE id = ANY($1) AND state = 'succeeded'`,
		issued).Scan(&succeeded))
	require.Equal(t, len(issued), succeeded)
	// The machines also ran the acceptance controller's commands: every
	// command of the deployment succeeded and ran once.
	var all, allSucceeded int
	require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state = 'succeeded') FROM commands`).
		Scan(&all, &allSucceeded))
	require.Equal(t, all, allSucceeded, "every command of the deployment succeeded")
	runs := 0
	for _, m := range machines {
		runs += m.Status().Runs
	}
	require.Equal(t, all, runs, "each command ran exactly once on its machine")

	boot1 := bootID(t, rebooted, 1)
	require.NotEqual(t, boot0, boot1)
	require.Eventually(t, func() bool { return rebooted.Status().BootID == boot1 }, 15*time.Second, 20*time.Millisecond,
		"the rebooted machine is back with its next boot id")
	var unreachable int
	require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM events WHERE type = 'node.unreachable'`).Scan(&unreachable))
	require.Zero(t, unreachable, "no node was marked unreachable by the failover")
}
