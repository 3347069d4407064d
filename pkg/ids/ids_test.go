package ids_test

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
)

func TestIDsSortByTimeAndCheck(t *testing.T) {
	t0 := time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC)
	var got []string
	for i := range 100 {
		got = append(got, ids.New(ids.Node, t0.Add(time.Duration(i/10)*time.Millisecond)))
	}
	require.True(t, slices.IsSorted(got), "ids of later times sort later, and monotonic within a millisecond")
	require.Len(t, slices.Compact(slices.Clone(got)), 100, "unique")
	for _, id := range got {
		require.NoError(t, ids.Check(ids.Node, id))
	}
	require.ErrorContains(t, ids.Check(ids.Pool, got[0]), `must start with "pool_"`)
	require.Error(t, ids.Check(ids.Node, "node_notaulid"))
}

// TestIDsOfOneMillisecondSortWhenInterleaved: ids made in the same
// millisecond sort in the order they were made even when ids of other
// milliseconds are made in between (parallel tests on fake clocks, or
// goroutines whose clock readings interleave).
func TestIDsOfOneMillisecondSortWhenInterleaved(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC)
	other := time.Date(2031, 6, 1, 0, 0, 0, 7e6, time.UTC) // other slots than t0's
	var got []string
	for i := range 200 {
		got = append(got, ids.New(ids.Reservation, t0))
		ids.New(ids.Command, other.Add(time.Duration(i%5)*time.Millisecond))
	}
	require.True(t, slices.IsSorted(got), "same-millisecond ids in the order they were made")
	require.Len(t, slices.Compact(slices.Clone(got)), 200, "unique")
}

// TestFloorBoundsIDsByTime: the ids made before a time's millisecond sort
// below Floor of that time, those made at it or later at or above it.
func TestFloorBoundsIDsByTime(t *testing.T) {
	t0 := time.Date(2030, 3, 4, 5, 6, 7, 891234567, time.UTC)
	floor := ids.Floor(ids.Command, t0)
	require.NoError(t, ids.Check(ids.Command, floor))
	for _, d := range []time.Duration{-24 * time.Hour, -time.Millisecond, -235 * time.Microsecond} {
		require.Less(t, ids.New(ids.Command, t0.Add(d)), floor, "made %v after t0", d)
	}
	for _, d := range []time.Duration{-234 * time.Microsecond, 0, time.Millisecond, 24 * time.Hour} {
		require.GreaterOrEqual(t, ids.New(ids.Command, t0.Add(d)), floor, "made %v after t0", d)
	}
	require.Equal(t, floor, ids.FromReader(ids.Command, t0, zeros{}), "the lowest id of its millisecond")
}

// zeros is an io.Reader of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
