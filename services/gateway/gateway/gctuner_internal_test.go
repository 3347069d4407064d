package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

// fakeHeap is what a gcTuner reads and sets in place of the runtime's.
type fakeHeap struct {
	allocs, live uint64
	sets         []int
	frees        int
}

func (h *fakeHeap) tuner(idle int) *gcTuner {
	return &gcTuner{idle: idle, current: idle, lastAllocs: h.allocs, lastLive: h.live,
		read: func() (uint64, uint64) { return h.allocs, h.live },
		set:  func(p int) int { h.sets = append(h.sets, p); return 0 },
		free: func() { h.frees++ }}
}

// TestGCTunerFollowsTheHeapsGrowth: the target stays idle while the heap
// grows by less than the idle target lets it between two ticks, turns to
// Go's default at the first tick that grew by more (the idle target would
// have collected in it), stays there while the growth lasts, and comes back
// after gcQuietTicks quiet ticks in a row, a busy one among them starting
// the count again, returning the busy heap's free pages then.
func TestGCTunerFollowsTheHeapsGrowth(t *testing.T) {
	h := &fakeHeap{allocs: 1 << 30, live: 16 << 20} // 16 MiB live: 25 % is 4 MiB
	tu := h.tuner(25)
	grow := func(mib uint64) { h.allocs += mib << 20; tu.tick() }

	grow(1) // an idle gateway's resyncs and heartbeats
	grow(4) // exactly what the idle target lets the heap grow: not busy
	require.Empty(t, h.sets, "idle")
	require.Equal(t, 25, tu.current)

	grow(5)
	require.Equal(t, []int{busyGCPercent}, h.sets, "busy at the first tick that outgrew the idle target")
	grow(40)
	grow(0)
	grow(0)
	grow(8) // busy again before the third quiet tick
	grow(0)
	grow(0)
	require.Equal(t, []int{busyGCPercent}, h.sets, "busy until gcQuietTicks quiet ticks in a row")
	grow(1)
	require.Equal(t, []int{busyGCPercent, 25}, h.sets, "idle again")
	require.Equal(t, 1, h.frees, "the busy heap's pages returned")
	grow(1)
	require.Equal(t, []int{busyGCPercent, 25}, h.sets)

	// A larger live heap (more sessions) lets it grow more before it is
	// busy.
	h.live = 400 << 20
	grow(90)
	require.Equal(t, []int{busyGCPercent, 25}, h.sets)
	grow(101)
	require.Equal(t, []int{busyGCPercent, 25, busyGCPercent}, h.sets)
}

// TestGCTunerStaysIdleWhileSessionsOpen: a heap outgrowing the idle target
// while what collections leave live grows by 5 % or more (sessions
// opening) is not busy.
func TestGCTunerStaysIdleWhileSessionsOpen(t *testing.T) {
	h := &fakeHeap{allocs: 1 << 30, live: 16 << 20}
	tu := h.tuner(25)
	for range 5 {
		h.live += h.live / 10
		h.allocs += 64 << 20
		tu.tick()
	}
	require.Empty(t, h.sets, "sessions opening: idle target")
	h.live += h.live / 50 // settled: +2 %
	h.allocs += 64 << 20
	tu.tick()
	require.Equal(t, []int{busyGCPercent}, h.sets, "busy once the live heap settles")
}

// TestGCTunerLeavesTheIdleTarget: when the gateway stops, the process is
// left at the idle target, whatever it was at.
func TestGCTunerLeavesTheIdleTarget(t *testing.T) {
	h := &fakeHeap{live: 16 << 20}
	tu := h.tuner(25)
	h.allocs += 64 << 20
	tu.tick()
	require.Equal(t, []int{busyGCPercent}, h.sets)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); tu.run(ctx, clock.NewFake(time.Unix(1_700_000_000, 0))) }()
	cancel()
	<-done
	require.Equal(t, []int{busyGCPercent, 25}, h.sets)
}
