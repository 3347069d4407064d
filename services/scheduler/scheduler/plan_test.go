package scheduler

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

var t0 = time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)

func node(id string, healthy int) store.PoolNode {
	n := store.PoolNode{ID: id, Schedulable: true, Devices: healthy}
	for i := range healthy {
		n.Healthy = append(n.Healthy, int32(i))
	}
	return n
}

// busy books devices 0..n-1 of node until an hour from t0.
func busy(nodeID string, n int) []store.BookedInterval {
	var out []store.BookedInterval
	for i := range n {
		out = append(out, store.BookedInterval{NodeID: nodeID, DeviceIndex: int32(i), Lower: t0.Add(-time.Hour), Upper: t0.Add(time.Hour)})
	}
	return out
}

func req(id string, gpus int, waited time.Duration) store.PendingReservation {
	return store.PendingReservation{ID: id, TenantID: "ten", PoolID: "pool", GPUs: gpus,
		StartAt: t0.Add(-waited), EndAt: t0.Add(2 * time.Hour), CreatedAt: t0.Add(-waited)}
}

// TestBestFitChoosesTheTightestNode: a request goes to the node whose free
// GPUs fit it most tightly, on its lowest free indexes, with ties broken by
// node id; each placement is counted before the next request is planned.
func TestBestFitChoosesTheTightestNode(t *testing.T) {
	nodes := []store.PoolNode{node("n-a", 8), node("n-b", 8), node("n-c", 8), node("n-d", 8)}
	var booked []store.BookedInterval
	booked = append(booked, busy("n-b", 4)...) // 4 free
	booked = append(booked, busy("n-c", 6)...) // 2 free
	booked = append(booked, busy("n-d", 6)...) // 2 free
	queue := []store.PendingReservation{req("r1", 2, 0), req("r2", 2, 0), req("r3", 3, 0), req("r4", 2, 0), req("r5", 8, 0)}
	p := planPool(queue, nodes, booked, t0, 5*time.Minute)
	require.Empty(t, p.Failures)
	got := map[string]store.Placement{}
	for _, pl := range p.Placements {
		got[pl.ReservationID] = pl
	}
	require.Equal(t, "n-c", got["r1"].NodeID, "2 free on n-c and n-d: the smaller id")
	require.Equal(t, []int32{6, 7}, got["r1"].Devices)
	require.Equal(t, "n-d", got["r2"].NodeID, "n-c is full now")
	require.Equal(t, "n-b", got["r3"].NodeID, "only n-b (4) and n-a (8) hold 3")
	require.Equal(t, []int32{4, 5, 6}, got["r3"].Devices)
	require.Equal(t, "n-a", got["r4"].NodeID, "n-b has 1 left")
	require.NotContains(t, got, "r5", "no node has 8 free any more")
	require.Equal(t, 1, p.Waiting)
	require.Equal(t, t0, got["r1"].Lower)
	require.Equal(t, t0.Add(2*time.Hour), got["r1"].Upper)
}

// TestSkipsUnschedulableAndUnhealthy: unreachable or cordoned nodes and
// unhealthy devices hold nothing, but a node's size still counts for "can
// ever fit".
func TestSkipsUnschedulableAndUnhealthy(t *testing.T) {
	off := node("n-a", 8)
	off.Schedulable = false
	sick := node("n-b", 8)
	sick.Healthy = []int32{0, 2, 4}
	p := planPool([]store.PendingReservation{req("r1", 4, 0), req("r2", 3, 0)}, []store.PoolNode{off, sick}, nil, t0, time.Minute)
	require.Empty(t, p.Failures)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "r2", p.Placements[0].ReservationID)
	require.Equal(t, []int32{0, 2, 4}, p.Placements[0].Devices)
	require.Equal(t, 1, p.Waiting)
}

// TestWaitingReasonNamesUnplaceableNodes: when nodes are cordoned,
// unreachable or have no healthy GPU, the waiting reason says how many of
// each and that the largest free count is over the placeable nodes only,
// not "no node has N free" alone while nodes sit idle behind a cordon.
func TestWaitingReasonNamesUnplaceableNodes(t *testing.T) {
	var nodes []store.PoolNode
	for _, id := range []string{"n-a", "n-b", "n-c"} {
		n := node(id, 8)
		n.Schedulable, n.Cordoned = false, true
		nodes = append(nodes, n)
	}
	gone := node("n-d", 8)
	gone.Schedulable, gone.Unreachable = false, true
	nodes = append(nodes, gone)
	p := planPool([]store.PendingReservation{req("r1", 1, 0)}, nodes, nil, t0, time.Minute)
	require.Empty(t, p.Placements)
	require.Equal(t, []store.PendingReason{{ID: "r1", Reason: "waiting: no node of pool pool has 1 free GPUs now " +
		"(3 nodes cordoned, 1 unreachable; largest free on a placeable node: 0)"}}, p.Reasons)

	sick := node("n-e", 8)
	sick.Healthy = nil
	full := node("n-f", 8)
	p = planPool([]store.PendingReservation{req("r1", 8, 0)}, []store.PoolNode{nodes[0], sick, full}, busy("n-f", 6), t0, time.Minute)
	require.Equal(t, []store.PendingReason{{ID: "r1", Reason: "waiting: no node of pool pool has 8 free GPUs now " +
		"(1 node cordoned, 1 without a healthy GPU; largest free on a placeable node: 2)"}}, p.Reasons)

	// Every node placeable: the reason is as before.
	p = planPool([]store.PendingReservation{req("r1", 8, 0)}, []store.PoolNode{full}, busy("n-f", 6), t0, time.Minute)
	require.Equal(t, []store.PendingReason{{ID: "r1", Reason: "waiting: no node of pool pool has 8 free GPUs now (largest free: 2)"}}, p.Reasons)
}

// TestNeverFitsFails: a request larger than every adopted node fails with
// the reason; the others are placed.
func TestNeverFitsFails(t *testing.T) {
	p := planPool([]store.PendingReservation{req("r1", 9, 0), req("r2", 8, 0)}, []store.PoolNode{node("n-a", 8), node("n-b", 4)}, nil, t0, time.Minute)
	require.Len(t, p.Failures, 1)
	require.Equal(t, "r1", p.Failures[0].ID)
	require.Equal(t, "no node of the pool can ever hold 9 GPUs: the largest adopted node has 8", p.Failures[0].Reason)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "n-a", p.Placements[0].NodeID)

	p = planPool([]store.PendingReservation{req("r1", 1, 0)}, nil, nil, t0, time.Minute)
	require.Len(t, p.Failures, 1, "a pool without adopted nodes can hold nothing")
}

// TestStarvationBound: a large request that does not fit lets smaller,
// newer ones pass until it has waited the bound; from then on it is the
// head: newer ones are placed only where they cannot delay it, and it takes
// the capacity as soon as it frees.
func TestStarvationBound(t *testing.T) {
	nodes := []store.PoolNode{node("n-a", 8)}
	booked := busy("n-a", 4) // until t0+1h
	bound := 5 * time.Minute

	p := planPool([]store.PendingReservation{req("big", 8, bound-time.Second), req("small", 2, 0)}, nodes, booked, t0, bound)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "small", p.Placements[0].ReservationID, "within the bound, small requests pass the big one")
	require.Empty(t, p.Head)

	short := req("short", 1, 0)
	short.EndAt = t0.Add(time.Hour)
	p = planPool([]store.PendingReservation{req("big", 8, bound), req("small", 2, 0), short, req("small2", 1, 0)}, nodes, booked, t0, bound)
	require.Equal(t, "big", p.Head)
	require.Equal(t, "n-a", p.ShadowNode)
	require.Equal(t, t0.Add(time.Hour), p.ShadowAt, "its shadow: when the 4 booked GPUs free")
	require.Len(t, p.Placements, 1, "past the bound, only what ends by the shadow time is placed on the shadow node")
	require.Equal(t, "short", p.Placements[0].ReservationID)
	require.Equal(t, 3, p.Waiting)
	require.Equal(t, []store.PendingReason{
		{ID: "big", Reason: "waiting: no node of pool pool has 8 free GPUs now (largest free: 4); next in line, on node n-a from 2030-01-01T13:00:00Z"},
		{ID: "small", Reason: "waiting behind big (past its bounded wait)"},
		{ID: "small2", Reason: "waiting behind big (past its bounded wait)"},
	}, p.Reasons)

	// Older requests ahead of it in the queue are still placed, and count in
	// its shadow: its last two GPUs free at t0+2h. A newer one that ends
	// exactly then does not delay it.
	big := req("big", 8, bound)
	big.EndAt = t0.Add(3 * time.Hour)
	p = planPool([]store.PendingReservation{req("older", 2, time.Hour), big, req("small", 1, 0)}, nodes, booked, t0, bound)
	require.Equal(t, "big", p.Head)
	require.Len(t, p.Placements, 2)
	require.Equal(t, "older", p.Placements[0].ReservationID)
	require.Equal(t, t0.Add(2*time.Hour), p.ShadowAt)
	require.Equal(t, "small", p.Placements[1].ReservationID)

	// A head that cannot start before its own end keeps nothing for itself.
	p = planPool([]store.PendingReservation{req("older", 2, time.Hour), req("big", 8, bound), req("small", 2, 0)}, nodes, booked, t0, bound)
	require.Empty(t, p.Head, "its shadow, t0+2h, is its end")
	require.Len(t, p.Placements, 2)

	// Capacity frees: the big one goes first.
	p = planPool([]store.PendingReservation{req("big", 8, bound), req("small", 2, 0)}, nodes, nil, t0, bound)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "big", p.Placements[0].ReservationID)
	require.Equal(t, 1, p.Waiting)
	require.Empty(t, p.Head, "it fits: no shadow to keep")
}

// TestBackfillAroundAStarvedHead is the new-user case: the fleet is nearly
// full, one node is booked for a year, and an 8-GPU request is past its
// bounded wait. Its shadow is the node that frees first; 1-GPU requests of
// any tenant are still placed now on the other nodes' free GPUs, or on the
// shadow node when they end before the shadow time; those that could only
// delay the head wait behind it, saying so. Reasons already stored are not
// written again.
func TestBackfillAroundAStarvedHead(t *testing.T) {
	bound := 5 * time.Minute
	nodes := []store.PoolNode{node("n-a", 8), node("n-b", 8), node("n-c", 8)}
	var booked []store.BookedInterval
	until := func(nodeID string, n int, end time.Time) {
		for i := range n {
			booked = append(booked, store.BookedInterval{NodeID: nodeID, DeviceIndex: int32(i), Lower: t0.Add(-time.Hour), Upper: end})
		}
	}
	until("n-a", 6, t0.Add(time.Hour))        // 2 free, all 8 at t0+1h
	until("n-b", 7, t0.Add(3*time.Hour))      // 1 free, all 8 at t0+3h
	until("n-c", 8, t0.Add(366*24*time.Hour)) // full for a year
	head := req("big", 8, time.Hour)
	head.EndAt = t0.Add(400 * 24 * time.Hour)
	long := req("long", 1, 0) // ends t0+2h: after the shadow time
	short := req("short", 1, 0)
	short.EndAt = t0.Add(30 * time.Minute)
	late := req("late", 1, 0) // fits only on n-a's last free GPU, past t0+1h
	late.Reason = "waiting behind big (past its bounded wait)"
	later := req("later", 2, 0) // fits nowhere now
	queue := []store.PendingReservation{head, long, short, late, later}

	p := planPool(queue, nodes, booked, t0, bound)
	require.Equal(t, "big", p.Head)
	require.Equal(t, "n-a", p.ShadowNode)
	require.Equal(t, t0.Add(time.Hour), p.ShadowAt)
	got := map[string]store.Placement{}
	for _, pl := range p.Placements {
		got[pl.ReservationID] = pl
	}
	require.Len(t, got, 2)
	require.Equal(t, "n-b", got["long"].NodeID, "not on the shadow node (best fit otherwise): it would hold a GPU of n-a past t0+1h")
	require.Equal(t, []int32{7}, got["long"].Devices)
	require.Equal(t, "n-a", got["short"].NodeID, "on the shadow node: it ends before the shadow time")
	require.Equal(t, []int32{6}, got["short"].Devices)
	require.Equal(t, 3, p.Waiting)
	require.Equal(t, []store.PendingReason{{ID: "big", Reason: "waiting: no node of pool pool has 8 free GPUs now (largest free: 2); " +
		"next in line, on node n-a from 2030-01-01T13:00:00Z"},
		{ID: "later", Reason: "waiting: no node of pool pool has 2 free GPUs now (largest free: 1)"},
	}, p.Reasons, "late's reason is already stored")

	// The head is not delayed: with the placements booked, it still starts
	// on n-a at t0+1h; and there it does start once the hour has passed.
	after := withPlacements(booked, p.Placements)
	states, _ := nodeStates(nodes, after, t0)
	ns, at, ok := shadowOf(states, 8, head.EndAt, t0)
	require.True(t, ok)
	require.Equal(t, "n-a", ns.node.ID)
	require.Equal(t, t0.Add(time.Hour), at)
	p = planPool(queue[:1], nodes, after, t0.Add(time.Hour), bound)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "big", p.Placements[0].ReservationID)
	require.Equal(t, "n-a", p.Placements[0].NodeID)
}

// TestHeadIsNeverDelayed: on random fleets and queues, whatever a pass
// places around a head past its bounded wait, the head still fits on its
// shadow node from its shadow time, and its shadow is no later than before;
// newer requests are still placed (backfilled) in some of them; and the
// plan is a pure function of its input.
func TestHeadIsNeverDelayed(t *testing.T) {
	bound := 5 * time.Minute
	rng := rand.New(rand.NewPCG(4, 2))
	heads, backfilled := 0, 0
	for round := range 500 {
		var nodes []store.PoolNode
		var booked []store.BookedInterval
		for n := range 2 + rng.IntN(5) {
			id := fmt.Sprintf("n-%d", n)
			nodes = append(nodes, node(id, 8))
			for d := range 8 {
				if rng.IntN(4) > 0 {
					booked = append(booked, store.BookedInterval{NodeID: id, DeviceIndex: int32(d), Lower: t0.Add(-time.Hour),
						Upper: t0.Add(time.Duration(1+rng.IntN(600)) * time.Minute)})
				}
			}
		}
		head := req("head", 5+rng.IntN(4), bound+time.Duration(rng.IntN(60))*time.Minute)
		head.EndAt = t0.Add(100 * time.Hour)
		queue := []store.PendingReservation{head}
		for i := range 20 {
			r := req(fmt.Sprintf("r%02d", i), 1+rng.IntN(8), time.Duration(rng.IntN(int(bound))))
			r.EndAt = t0.Add(time.Duration(10+rng.IntN(1200)) * time.Minute)
			queue = append(queue, r)
		}
		p := planPool(queue, nodes, booked, t0, bound)
		require.Equal(t, p, planPool(queue, nodes, booked, t0, bound), "round %d: deterministic", round)
		if p.Head != "head" {
			continue
		}
		heads++
		states, _ := nodeStates(nodes, booked, t0)
		_, before, _ := shadowOf(states, head.GPUs, head.EndAt, t0)
		require.Equal(t, before, p.ShadowAt, "round %d", round)

		after := withPlacements(booked, p.Placements)
		backfilled += len(p.Placements)
		free := 0
		for d := range int32(8) {
			clear := true
			for _, b := range after {
				if b.NodeID == p.ShadowNode && b.DeviceIndex == d && b.Lower.Before(head.EndAt) && p.ShadowAt.Before(b.Upper) {
					clear = false
				}
			}
			if clear {
				free++
			}
		}
		require.GreaterOrEqual(t, free, head.GPUs, "round %d: the head fits on %s from %s", round, p.ShadowNode, p.ShadowAt)
		states, _ = nodeStates(nodes, after, t0)
		_, at, ok := shadowOf(states, head.GPUs, head.EndAt, t0)
		require.True(t, ok)
		require.False(t, at.After(p.ShadowAt), "round %d: the head's shadow moved from %s to %s", round, p.ShadowAt, at)
	}
	require.Greater(t, heads, 50, "rounds with a starved head")
	require.Greater(t, backfilled, heads, "requests placed around starved heads")
}

// withPlacements is booked with the placements' bookings added.
func withPlacements(booked []store.BookedInterval, ps []store.Placement) []store.BookedInterval {
	out := slices.Clone(booked)
	for _, pl := range ps {
		for _, d := range pl.Devices {
			out = append(out, store.BookedInterval{NodeID: pl.NodeID, DeviceIndex: d, Lower: pl.Lower, Upper: pl.Upper})
		}
	}
	return out
}

// TestCountFreeShortcut: countFree's shortcut (unbooked devices when every
// booking starts before hi) counts what looking at each device counts, on
// random bookings in the past and future and after placements (book).
func TestCountFreeShortcut(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(7, 19))
	slow := func(ns *nodeState, hi time.Time) int {
		n := 0
		for i := range ns.next {
			if ns.isFree(i, hi) {
				n++
			}
		}
		return n
	}
	for round := range 500 {
		n := node(fmt.Sprintf("n%03d", round), 1+rng.IntN(8))
		var booked []store.BookedInterval
		for range rng.IntN(12) {
			lo := t0.Add(time.Duration(rng.IntN(240)-120) * time.Minute)
			booked = append(booked, store.BookedInterval{NodeID: n.ID, DeviceIndex: int32(rng.IntN(len(n.Healthy))),
				Lower: lo, Upper: lo.Add(time.Duration(1+rng.IntN(120)) * time.Minute)})
		}
		states, _ := nodeStates([]store.PoolNode{n}, booked, t0)
		require.Len(t, states, 1)
		ns := states[0]
		for step := range 6 {
			if step > 0 {
				ns.book(rng.IntN(len(ns.next)), t0)
			}
			for range 8 {
				hi := t0.Add(time.Duration(1+rng.IntN(180)) * time.Minute)
				require.Equal(t, slow(ns, hi), ns.countFree(hi), "round %d step %d, hi %s", round, step, hi)
			}
		}
	}
}

// BenchmarkPlanPool plans 2,000 reservations of 2 GPUs on 1,000 nodes of 8
// GPUs, 2,000 bookings already there (BenchmarkPass's second pass, in
// memory).
func BenchmarkPlanPool(b *testing.B) {
	nodes := make([]store.PoolNode, 1000)
	var booked []store.BookedInterval
	for i := range nodes {
		nodes[i] = node(fmt.Sprintf("n%04d", i), 8)
		for d := range int32(2) {
			booked = append(booked, store.BookedInterval{NodeID: nodes[i].ID, DeviceIndex: d,
				Lower: t0.Add(-time.Minute), Upper: t0.Add(time.Hour)})
		}
	}
	queue := make([]store.PendingReservation, 2000)
	for i := range queue {
		queue[i] = store.PendingReservation{ID: fmt.Sprintf("r%05d", i), PoolID: "pool", GPUs: 2,
			StartAt: t0, EndAt: t0.Add(time.Hour), CreatedAt: t0}
	}
	b.ReportAllocs()
	for b.Loop() {
		p := planPool(queue, nodes, booked, t0, 5*time.Minute)
		if len(p.Placements) != len(queue) {
			b.Fatalf("placed %d of %d", len(p.Placements), len(queue))
		}
	}
}
