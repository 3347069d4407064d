package scheduler

import (
	"fmt"
	"slices"
	"time"

	"github.com/better-compute/better-compute/pkg/store"
)

// Plan is what one pass decides for one pool.
type Plan struct {
	// Placements are the reservations to place, in queue order.
	Placements []store.Placement
	// Failures are the reservations no node of the pool can ever hold.
	Failures []store.ReservationFailure
	// Waiting is how many reservations stay pending (no room yet).
	Waiting int
	// BlockedBy is the reservation that waited past the starvation bound
	// and holds back every newer one of the pool ("" when none).
	BlockedBy string
}

// planPool places the pool's FIFO queue (pending, oldest first) on nodes
// with the bookings booked, at now (DESIGN §3):
//
//   - Each reservation goes whole onto one schedulable node (reachable,
//     uncordoned, adopted, not revoked) on its free healthy devices: those
//     without a booking overlapping [now, end_at).
//   - Best fit: the node with the fewest free devices that still holds it
//     (ties: the smaller node id); the lowest free device indexes.
//   - A reservation larger than every adopted node of the pool (counting
//     all their devices, healthy or not, reachable or not) can never be
//     placed: it fails with a reason.
//   - No head-of-line blocking: a reservation that does not fit yet is
//     skipped and newer ones behind it may still be placed; but once it has
//     waited starvation or longer (since max(created_at, start_at)), the
//     pool places nothing newer than it until it is placed, so capacity that
//     frees up goes to it first.
func planPool(queue []store.PendingReservation, nodes []store.PoolNode, booked []store.BookedInterval,
	now time.Time, starvation time.Duration) Plan {
	// Every window planned here starts at now, and a booking overlaps
	// [now, hi) exactly when it ends after now and starts before hi. So each
	// healthy device needs only next: the start of its earliest booking that
	// ends after now (zero when it has none); it is free for [now, hi) when
	// next is zero or not before hi. This keeps a pass linear in bookings.
	type nodeState struct {
		node *store.PoolNode
		// next is per device of node.Healthy, in that order.
		next []time.Time
	}
	states := make([]*nodeState, 0, len(nodes))
	byID := make(map[string]*nodeState, len(nodes))
	largest := 0
	for i := range nodes {
		n := &nodes[i]
		largest = max(largest, n.Devices)
		if !n.Schedulable || len(n.Healthy) == 0 {
			continue
		}
		ns := &nodeState{node: n, next: make([]time.Time, len(n.Healthy))}
		states = append(states, ns)
		byID[n.ID] = ns
	}
	for _, b := range booked {
		ns := byID[b.NodeID]
		if ns == nil || !now.Before(b.Upper) {
			continue
		}
		if i, ok := slices.BinarySearch(ns.node.Healthy, b.DeviceIndex); ok {
			if ns.next[i].IsZero() || b.Lower.Before(ns.next[i]) {
				ns.next[i] = b.Lower
			}
		}
	}
	isFree := func(ns *nodeState, i int, hi time.Time) bool {
		return ns.next[i].IsZero() || !ns.next[i].Before(hi)
	}
	countFree := func(ns *nodeState, hi time.Time) int {
		n := 0
		for i := range ns.next {
			if isFree(ns, i, hi) {
				n++
			}
		}
		return n
	}

	var p Plan
	for _, r := range queue {
		if r.GPUs > largest {
			p.Failures = append(p.Failures, store.ReservationFailure{ID: r.ID, TenantID: r.TenantID,
				Reason: fmt.Sprintf("no node of the pool can ever hold %d GPUs: the largest adopted node has %d", r.GPUs, largest)})
			continue
		}
		if p.BlockedBy != "" {
			p.Waiting++
			continue
		}
		lo, hi := now, r.EndAt
		var (
			best     *nodeState
			bestFree int
		)
		for _, ns := range states {
			n := countFree(ns, hi)
			if n < r.GPUs {
				continue
			}
			if best == nil || n < bestFree || (n == bestFree && ns.node.ID < best.node.ID) {
				best, bestFree = ns, n
			}
		}
		if best == nil {
			p.Waiting++
			if now.Sub(later(r.CreatedAt, r.StartAt)) >= starvation {
				p.BlockedBy = r.ID
			}
			continue
		}
		devs := make([]int32, 0, r.GPUs)
		for i, d := range best.node.Healthy {
			if len(devs) < r.GPUs && isFree(best, i, hi) {
				devs = append(devs, d)
				if lo.Before(hi) {
					best.next[i] = lo
				}
			}
		}
		p.Placements = append(p.Placements, store.Placement{ReservationID: r.ID, TenantID: r.TenantID,
			NodeID: best.node.ID, Devices: devs, Lower: lo, Upper: hi})
	}
	return p
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
