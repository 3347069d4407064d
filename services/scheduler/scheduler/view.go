package scheduler

import (
	"context"
	"slices"
	"time"

	"github.com/better-compute/better-compute/pkg/store"
)

// poolView is one pool's capacity as this replica holds it between passes:
// each adopted, non-revoked node with its capacity generation, its state and
// devices, and its bookings that end after the last pass's now. It is built
// from store.PoolCapacitySince, then kept current by the replica's own
// placements (store.PlaceResult: the bookings it wrote, the nodes'
// generations once committed); each pass reads back, in one statement, only
// the nodes whose generation moved since (another writer changed them: a
// node's state, its devices, a booking's end, another replica's placement).
//
// The database stays the source of truth: a placement is written only onto
// nodes whose generation, read under their lock, is the view's
// (store.PlaceReservationsAt skips the others, and the view reads them
// again), and a booking that overlaps a committed one fails on the bookings'
// exclusion constraint (I1), after which the pool's view is dropped and
// built again from scratch.
type poolView struct {
	// nodes are the pool's nodes by id.
	nodes map[string]*viewNode
}

// viewNode is one node of a poolView.
type viewNode struct {
	// gen is the node's capacity generation as of node and booked; -1 when
	// the view knows it is stale (read it again).
	gen    int64
	node   store.PoolNode
	booked []store.BookedInterval
}

// staleGen is the generation of a node the view must read again.
const staleGen = -1

// capacity returns the nodes (by id) and bookings ending after now of the
// pool, reading back from the database only what changed since the view
// last read it (everything when there is no view).
func (s *Server) capacity(ctx context.Context, poolID string, now time.Time) ([]store.PoolNode, []store.BookedInterval, error) {
	v := s.views[poolID]
	var known map[string]int64
	if v != nil {
		known = make(map[string]int64, len(v.nodes))
		for id, n := range v.nodes {
			known[id] = n.gen
		}
	}
	got, err := store.PoolCapacitySince(ctx, s.db.Pool, poolID, now, known)
	if err != nil {
		return nil, nil, err
	}
	next := &poolView{nodes: make(map[string]*viewNode, len(got))}
	for _, c := range got {
		old := (*viewNode)(nil)
		if v != nil {
			old = v.nodes[c.ID]
		}
		if c.Changed || old == nil {
			next.nodes[c.ID] = &viewNode{gen: c.Generation, node: c.Node, booked: c.Booked}
			continue
		}
		old.booked = slices.DeleteFunc(old.booked, func(b store.BookedInterval) bool { return !now.Before(b.Upper) })
		next.nodes[c.ID] = old
	}
	s.views[poolID] = next
	return next.flatten(), next.bookings(), nil
}

// flatten returns the view's nodes by id.
func (v *poolView) flatten() []store.PoolNode {
	out := make([]store.PoolNode, 0, len(v.nodes))
	for _, n := range v.nodes {
		out = append(out, n.node)
	}
	slices.SortFunc(out, func(a, b store.PoolNode) int {
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	return out
}

// bookings returns the view's bookings.
func (v *poolView) bookings() []store.BookedInterval {
	n := 0
	for _, vn := range v.nodes {
		n += len(vn.booked)
	}
	out := make([]store.BookedInterval, 0, n)
	for _, vn := range v.nodes {
		out = append(out, vn.booked...)
	}
	return out
}

// generations returns the view's generation of each node of ps.
func (s *Server) generations(poolID string, ps []store.Placement) map[string]int64 {
	out := make(map[string]int64, len(ps))
	v := s.views[poolID]
	for _, p := range ps {
		gen := int64(staleGen)
		if v != nil {
			if n := v.nodes[p.NodeID]; n != nil {
				gen = n.gen
			}
		}
		out[p.NodeID] = gen
	}
	return out
}

// applyPlaced applies a committed placement batch to the pool's view: the
// bookings of the placed reservations and the nodes' new generations; the
// nodes it skipped are read again by the next pass.
func (s *Server) applyPlaced(poolID string, ps []store.Placement, res store.PlaceResult) {
	v := s.views[poolID]
	if v == nil {
		return
	}
	done := make(map[string]bool, len(res.Placed))
	for _, id := range res.Placed {
		done[id] = true
	}
	for _, p := range ps {
		n := v.nodes[p.NodeID]
		if n == nil || !done[p.ReservationID] {
			continue
		}
		for _, d := range p.Devices {
			n.booked = append(n.booked, store.BookedInterval{NodeID: p.NodeID, DeviceIndex: d, Lower: p.Lower, Upper: p.Upper})
		}
	}
	for id, gen := range res.Generations {
		if n := v.nodes[id]; n != nil {
			n.gen = gen
		}
	}
	for _, id := range res.Skipped {
		if n := v.nodes[id]; n != nil {
			n.gen = staleGen
		}
	}
}

// dropView forgets the pool's view: the next pass reads it whole.
func (s *Server) dropView(poolID string) { delete(s.views, poolID) }
