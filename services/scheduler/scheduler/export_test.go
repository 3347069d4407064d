package scheduler

import (
	"context"

	"github.com/better-compute/better-compute/pkg/store"
)

// CapacityView returns the pool's view as the replica holds it between
// passes (ok false when it holds none): its nodes by id, their bookings and
// generations.
func (s *Server) CapacityView(poolID string) (nodes []store.PoolNode, booked []store.BookedInterval, gens map[string]int64, ok bool) {
	s.passMu.Lock()
	defer s.passMu.Unlock()
	v := s.views[poolID]
	if v == nil {
		return nil, nil, nil, false
	}
	gens = map[string]int64{}
	for id, n := range v.nodes {
		gens[id] = n.gen
	}
	return v.flatten(), v.bookings(), gens, true
}

// RefreshCapacityView brings the pool's view up to date as a pass does
// before it plans.
func (s *Server) RefreshCapacityView(ctx context.Context, poolID string) error {
	s.passMu.Lock()
	defer s.passMu.Unlock()
	_, _, err := s.capacity(ctx, poolID, s.now())
	return err
}
