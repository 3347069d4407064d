package scheduler

import (
	"fmt"
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
	type nodeState struct {
		node *store.PoolNode
		// busy holds each healthy device's booked intervals.
		busy map[int32][]store.BookedInterval
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
		ns := &nodeState{node: n, busy: map[int32][]store.BookedInterval{}}
		states = append(states, ns)
		byID[n.ID] = ns
	}
	for _, b := range booked {
		if ns := byID[b.NodeID]; ns != nil {
			ns.busy[b.DeviceIndex] = append(ns.busy[b.DeviceIndex], b)
		}
	}
	isFree := func(ns *nodeState, d int32, lo, hi time.Time) bool {
		for _, b := range ns.busy[d] {
			if b.Lower.Before(hi) && lo.Before(b.Upper) {
				return false
			}
		}
		return true
	}
	countFree := func(ns *nodeState, lo, hi time.Time) int {
		n := 0
		for _, d := range ns.node.Healthy {
			if isFree(ns, d, lo, hi) {
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
			n := countFree(ns, lo, hi)
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
		for _, d := range best.node.Healthy {
			if len(devs) < r.GPUs && isFree(best, d, lo, hi) {
				devs = append(devs, d)
			}
		}
		for _, d := range devs {
			best.busy[d] = append(best.busy[d], store.BookedInterval{NodeID: best.node.ID, DeviceIndex: d, Lower: lo, Upper: hi})
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
