package gateway_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// openStatements returns the statements of sql that a session's open
// sends, leaving out its first delivery's claim (store.ClaimSessionDeliveries,
// told by the deliveries count it bumps) and the outbox's NOTIFY, sent after
// the commit by a goroutine of its own, which may each start before the
// Welcome arrives or after.
func openStatements(sql []string) []string {
	var out []string
	for _, s := range sql {
		if strings.Contains(s, "deliveries = c.deliveries + 1") || strings.Contains(s, "pg_notify") {
			continue
		}
		out = append(out, s)
	}
	return out
}

// TestSessionOpenStatements: a Hello costs one statement up to the Welcome,
// which checks the client certificate, opens the session and writes the
// node.reachable event (store.OpenSessions), with no transaction around it;
// its delivery's claim and the outbox's NOTIFY aside. The clock is fake, so
// that no periodic flush runs meanwhile. Not parallel: the counter sees
// every statement of the process.
func TestSessionOpenStatements(t *testing.T) {
	e := setup(t, options{clock: clock.NewFake(realClock.Now())})
	g := e.startGateway(noResync)
	// The first session waits for the gateway's start.
	e.connect(g, e.newNode(), nil)

	n := e.newNode()
	stmts := storetest.CountStatements()
	_, w := e.connect(g, n, nil)
	stmts.Stop()
	got := openStatements(stmts.SQL())
	require.Len(t, got, 1, strings.Join(got, "\n---\n"))
	require.EqualValues(t, 1, w.GetSessionEpoch())
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)
}

// BenchmarkSessionOpenStatements opens the sessions of 64 nodes, by 1 and
// by 16 concurrent daemons (Hellos that arrive together share a
// transaction), each session up to its Welcome, and reports the SQL
// statements per open (BEGIN and COMMIT counted when there are, the first
// deliveries' claims and the outbox's NOTIFYs aside) and nanoseconds per open. BENCH_SQL=1 prints the
// statements of the last round.
func BenchmarkSessionOpenStatements(b *testing.B) {
	const opens = 64
	for _, callers := range []int{1, 16} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			e := setup(b, options{clock: clock.NewFake(realClock.Now())})
			g := e.startGateway(noResync)
			e.connect(g, e.newNode(), nil)
			stmts := storetest.CountStatements()
			var total int
			for b.Loop() {
				b.StopTimer()
				clients := make(chan openClient, opens)
				for range opens {
					n := e.newNode()
					clients <- openClient{c: e.client(g, n.cert), id: n.id}
				}
				close(clients)
				stmts.Reset()
				b.StartTimer()
				// The sessions stay open until the benchmark ends: their
				// closes would write during the next round.
				var wg sync.WaitGroup
				for range callers {
					wg.Go(func() {
						for c := range clients {
							e.connectWith(c.c, &gatewayv1.Hello{NodeId: c.id, BootId: "boot-1", AgentVersion: "test"})
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				stmts.Stop()
				total += len(openStatements(stmts.SQL()))
				b.StartTimer()
			}
			b.ReportMetric(float64(total)/float64(opens*b.N), "stmts/open")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(opens*b.N), "ns/open")
			if os.Getenv("BENCH_SQL") != "" {
				for _, s := range stmts.SQL() {
					b.Log("SQL: " + strings.Join(strings.Fields(s), " "))
				}
			}
		})
	}
}

// openClient is a client with the client certificate of node id.
type openClient struct {
	c  gatewayv1connect.GatewayServiceClient
	id string
}

// TestHelloGoneDuringItsOpenLeavesNoSession: a daemon that goes away while
// its Hello's open waits in a flush (here for the node's row lock) does not
// leave the node's session open, held by a live gateway and so never swept
// unreachable: the open is waited for and then closed (the sweeper then
// marks the node unreachable, as after any session's end).
func TestHelloGoneDuringItsOpenLeavesNoSession(t *testing.T) {
	e := setup(t, options{})
	g := e.startGateway(noResync)
	e.connect(g, e.newNode(), nil)
	n := e.newNode()

	ctx := context.Background()
	tx, err := e.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE`, n.id)
	require.NoError(t, err)

	d := e.open(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "boot-1", AgentVersion: "test"})
	// The open's flush waits for the row lock.
	require.Eventually(t, func() bool {
		var waiting int
		require.NoError(t, e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted`).Scan(&waiting))
		return waiting > 0
	}, 10*time.Second, 10*time.Millisecond)
	d.close() // the daemon goes away mid-Hello
	// Time for the gateway to see the stream end before the open commits.
	require.NoError(t, clock.Sleep(ctx, realClock, 300*time.Millisecond))
	require.NoError(t, tx.Commit(ctx))

	// The open commits (the epoch moves), then the session is closed.
	require.Eventually(t, func() bool {
		r := e.nodeRow(n.id)
		return r.Epoch >= 1 && r.SessionID == nil && r.GatewayID == nil
	}, 10*time.Second, 20*time.Millisecond, "the session of a Hello whose stream ended is closed")
}
