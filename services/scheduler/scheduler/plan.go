package scheduler

import (
	"fmt"
	"slices"
	"strings"
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
	// Reasons are the reasons of the reservations that stay pending, only
	// those that differ from their stored reason (PendingReservation.Reason).
	Reasons []store.PendingReason
	// Head is the oldest reservation that waited past the starvation bound,
	// does not fit now and has a shadow ("" when none): the pool keeps its
	// shadow for it.
	Head string
	// ShadowNode and ShadowAt are the head's shadow: the node and the
	// earliest time at which it is sure to fit given the current bookings.
	ShadowNode string
	ShadowAt   time.Time
}

// planPool places the pool's FIFO queue (pending, oldest first) on nodes
// with the bookings booked, at now (docs/architecture.md, "Reservations"). It is a pure function of
// its arguments, so racing replicas plan alike:
//
//   - Each reservation goes whole onto one schedulable node (reachable,
//     uncordoned, adopted, not revoked) on its free healthy devices: those
//     without a booking overlapping [now, end_at).
//   - Best fit: the node with the fewest free devices that still holds it
//     (ties: the smaller node id); the lowest free device indexes.
//   - A reservation larger than every adopted node of the pool (counting
//     all their devices, healthy or not, reachable or not) can never be
//     placed: it fails with a reason.
//   - No head-of-line blocking, EASY backfilling: a reservation that does
//     not fit yet is skipped and newer ones behind it may still be placed.
//     The first one in the queue that has waited starvation or longer
//     (since max(created_at, start_at)) without fitting becomes the head:
//     its shadow (see shadowOf) is the node and time at which it is sure to
//     start, and newer reservations are placed only where they cannot delay
//     it: on other nodes, or on the shadow node when they end by the shadow
//     time. So the head starts no later than its shadow, and a small
//     reservation waits only until it fits somewhere without delaying it.
//   - Each reservation that stays pending gets a reason (Plan.Reasons).
func planPool(queue []store.PendingReservation, nodes []store.PoolNode, booked []store.BookedInterval,
	now time.Time, starvation time.Duration) Plan {
	states, largest := nodeStates(nodes, booked, now)
	var (
		p        Plan
		shadow   *nodeState
		shadowAt time.Time
	)
	for _, r := range queue {
		if r.GPUs > largest {
			p.Failures = append(p.Failures, store.ReservationFailure{ID: r.ID, TenantID: r.TenantID,
				Reason: fmt.Sprintf("no node of the pool can ever hold %d GPUs: the largest adopted node has %d", r.GPUs, largest)})
			continue
		}
		lo, hi := now, r.EndAt
		var (
			best, fits         *nodeState
			bestFree, mostFree int
		)
		for _, ns := range states {
			n := ns.countFree(hi)
			mostFree = max(mostFree, n)
			if n < r.GPUs {
				continue
			}
			fits = ns
			if ns == shadow && hi.After(shadowAt) {
				continue // it would delay the head
			}
			if best == nil || n < bestFree || (n == bestFree && ns.node.ID < best.node.ID) {
				best, bestFree = ns, n
			}
		}
		if best == nil {
			p.Waiting++
			reason := waitingReason(r, nodes, mostFree)
			if fits != nil {
				reason = fmt.Sprintf("waiting behind %s (past its bounded wait)", p.Head)
			} else if p.Head == "" && now.Sub(later(r.CreatedAt, r.StartAt)) >= starvation {
				if ns, at, ok := shadowOf(states, r.GPUs, r.EndAt, now); ok {
					p.Head, p.ShadowNode, p.ShadowAt = r.ID, ns.node.ID, at
					shadow, shadowAt = ns, at
					reason += fmt.Sprintf("; next in line, on node %s from %s", ns.node.ID, at.UTC().Format(time.RFC3339))
				}
			}
			if reason != r.Reason {
				p.Reasons = append(p.Reasons, store.PendingReason{ID: r.ID, Reason: reason})
			}
			continue
		}
		devs := make([]int32, 0, r.GPUs)
		for i, d := range best.node.Healthy {
			if len(devs) < r.GPUs && best.isFree(i, hi) {
				devs = append(devs, d)
				if lo.Before(hi) {
					best.book(i, lo)
					if hi.After(best.freeAt[i]) {
						best.freeAt[i] = hi
					}
				}
			}
		}
		p.Placements = append(p.Placements, store.Placement{ReservationID: r.ID, TenantID: r.TenantID,
			NodeID: best.node.ID, Devices: devs, Lower: lo, Upper: hi})
	}
	return p
}

// waitingReason is the reason of r when no placeable node has r.GPUs free
// now; mostFree is the most GPUs free on a placeable node. When some adopted
// nodes cannot be placed on (cordoned, unreachable, or with no healthy GPU),
// it counts them by cause (each node once, in that order), so that a pool
// whose nodes are all cordoned does not read as a full pool.
func waitingReason(r store.PendingReservation, nodes []store.PoolNode, mostFree int) string {
	var cordoned, unreachable, unhealthy int
	for _, n := range nodes {
		switch {
		case n.Cordoned:
			cordoned++
		case n.Unreachable || !n.Schedulable:
			unreachable++
		case len(n.Healthy) == 0:
			unhealthy++
		}
	}
	var causes []string
	if cordoned > 0 {
		causes = append(causes, fmt.Sprintf("%d %s cordoned", cordoned, plural(cordoned, "node", "nodes")))
	}
	if unreachable > 0 {
		causes = append(causes, fmt.Sprintf("%d unreachable", unreachable))
	}
	if unhealthy > 0 {
		causes = append(causes, fmt.Sprintf("%d without a healthy GPU", unhealthy))
	}
	if len(causes) == 0 {
		return fmt.Sprintf("waiting: no node of pool %s has %d free GPUs now (largest free: %d)", r.PoolID, r.GPUs, mostFree)
	}
	return fmt.Sprintf("waiting: no node of pool %s has %d free GPUs now (%s; largest free on a placeable node: %d)",
		r.PoolID, r.GPUs, strings.Join(causes, ", "), mostFree)
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// nodeState is a schedulable node's healthy devices as a pass sees them.
// Every window planned in a pass starts at now, and a booking overlaps
// [now, hi) exactly when it ends after now and starts before hi. So each
// device needs only next (for placing now) and freeAt (for the shadow),
// which keeps a pass linear in bookings.
type nodeState struct {
	node *store.PoolNode
	// next is per device of node.Healthy, in that order: the start of its
	// earliest booking that ends after now (zero when it has none). The
	// device is free for [now, hi) when next is zero or not before hi.
	next []time.Time
	// freeAt is per device of node.Healthy: the end of its latest booking
	// that ends after now (zero when it has none), from when it is free for
	// good.
	freeAt []time.Time
	// unbooked is how many entries of next are zero, and lastNext is no
	// earlier than every non-zero one (zero when there is none): when
	// lastNext is before hi, exactly the unbooked devices are free for
	// [now, hi), and countFree needs no look at the devices.
	unbooked int
	lastNext time.Time
}

// book sets device i's next booking to start at lo (not zero).
func (ns *nodeState) book(i int, lo time.Time) {
	if ns.next[i].IsZero() {
		ns.unbooked--
	}
	ns.next[i] = lo
	if lo.After(ns.lastNext) {
		ns.lastNext = lo
	}
}

// nodeStates returns the states of the schedulable nodes with healthy
// devices, in the order of nodes, and the most devices of any node
// (schedulable or not, healthy or not).
func nodeStates(nodes []store.PoolNode, booked []store.BookedInterval, now time.Time) ([]*nodeState, int) {
	states := make([]*nodeState, 0, len(nodes))
	byID := make(map[string]*nodeState, len(nodes))
	largest := 0
	for i := range nodes {
		n := &nodes[i]
		largest = max(largest, n.Devices)
		if !n.Schedulable || len(n.Healthy) == 0 {
			continue
		}
		ns := &nodeState{node: n, next: make([]time.Time, len(n.Healthy)), freeAt: make([]time.Time, len(n.Healthy))}
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
				if b.Lower.After(ns.lastNext) {
					ns.lastNext = b.Lower
				}
			}
			if b.Upper.After(ns.freeAt[i]) {
				ns.freeAt[i] = b.Upper
			}
		}
	}
	for _, ns := range states {
		for _, t := range ns.next {
			if t.IsZero() {
				ns.unbooked++
			}
		}
	}
	return states, largest
}

func (ns *nodeState) isFree(i int, hi time.Time) bool {
	return ns.next[i].IsZero() || !ns.next[i].Before(hi)
}

func (ns *nodeState) countFree(hi time.Time) int {
	if ns.lastNext.Before(hi) {
		return ns.unbooked
	}
	n := 0
	for i := range ns.next {
		if ns.isFree(i, hi) {
			n++
		}
	}
	return n
}

// shadowOf returns the shadow of a reservation of gpus GPUs that ends at
// end: on each node, the time its gpus-th device frees for good (each
// device at the end of its latest booking, now when it has none; a
// reservation is whole on one node); the earliest such time before end,
// ties to the node with the fewest devices free by then (best fit), then
// the smaller id. ok is false when no schedulable node can start it before
// end.
func shadowOf(states []*nodeState, gpus int, end, now time.Time) (node *nodeState, at time.Time, ok bool) {
	bestFree := 0
	times := make([]time.Time, 0, 8)
	for _, ns := range states {
		if len(ns.freeAt) < gpus {
			continue
		}
		times = times[:0]
		for _, t := range ns.freeAt {
			times = append(times, later(t, now))
		}
		slices.SortFunc(times, time.Time.Compare)
		t := times[gpus-1]
		if !t.Before(end) {
			continue
		}
		free := gpus
		for free < len(times) && !times[free].After(t) {
			free++
		}
		if !ok || t.Before(at) || (t.Equal(at) && (free < bestFree || (free == bestFree && ns.node.ID < node.node.ID))) {
			node, at, bestFree, ok = ns, t, free, true
		}
	}
	return node, at, ok
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
