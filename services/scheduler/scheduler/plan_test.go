package scheduler

import (
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
// newer ones pass until it has waited the bound; from then on nothing newer
// is placed in the pool, and it takes the capacity as soon as it frees.
func TestStarvationBound(t *testing.T) {
	nodes := []store.PoolNode{node("n-a", 8)}
	booked := busy("n-a", 4)
	bound := 5 * time.Minute

	p := planPool([]store.PendingReservation{req("big", 8, bound-time.Second), req("small", 2, 0)}, nodes, booked, t0, bound)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "small", p.Placements[0].ReservationID, "within the bound, small requests pass the big one")
	require.Empty(t, p.BlockedBy)

	p = planPool([]store.PendingReservation{req("big", 8, bound), req("small", 2, 0), req("small2", 1, 0)}, nodes, booked, t0, bound)
	require.Empty(t, p.Placements, "past the bound, nothing newer is placed around it")
	require.Equal(t, "big", p.BlockedBy)
	require.Equal(t, 3, p.Waiting)

	// Older requests ahead of it in the queue are still placed.
	p = planPool([]store.PendingReservation{req("older", 2, time.Hour), req("big", 8, bound), req("small", 1, 0)}, nodes, booked, t0, bound)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "older", p.Placements[0].ReservationID)

	// Capacity frees: the big one goes first.
	p = planPool([]store.PendingReservation{req("big", 8, bound), req("small", 2, 0)}, nodes, nil, t0, bound)
	require.Len(t, p.Placements, 1)
	require.Equal(t, "big", p.Placements[0].ReservationID)
	require.Equal(t, 1, p.Waiting)
}
