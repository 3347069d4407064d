package gateway

import (
	"context"
	"runtime/debug"
	rtmetrics "runtime/metrics"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
)

// busyGCPercent is the collector's target while the gateway is busy: Go's
// default.
const busyGCPercent = 100

// gcTuneInterval is how often gcTuner reads the heap's growth.
const gcTuneInterval = 2 * time.Second

// gcLiveGrowth: an interval in which what the collections left live grew
// by more than 1/gcLiveGrowth is not busy.
const gcLiveGrowth = 20

// gcQuietTicks is how many intervals in a row without a busy one bring the
// target back to the idle one.
const gcQuietTicks = 3

// gcTuner keeps the process's garbage collector at Config.GCPercent (the
// idle target, below Go's default) while the gateway is idle, and at Go's
// default while it is busy. Idle, the gateway's heap is nearly all its
// sessions', and a low target keeps each session's resident memory small
// for a few collections a minute. Busy (a join burst, a stream of
// commands), the same target would collect several times a second, a
// fifth of the gateway's CPU in the profiles of docs/benchmarks.md: the
// heap's growth is then garbage, and collecting it four times less often
// costs a transient heap above the sessions' only while the burst lasts.
//
// An interval is busy when the heap allocated more in it than the idle
// target lets it grow past what the last collection left live (that is,
// when the idle target would have collected at least once in it), and
// what collections leave live grew by less than 5 % in it: while sessions
// are opening (a join burst, a gateway's restart) their objects are
// allocated among the burst's garbage, and a collection four times rarer
// spreads them over more of the heap's spans, which stay in use as long
// as the sessions (several KiB more of resident memory per idle session
// in BenchmarkIdleFleet). The
// target goes back to the idle one after gcQuietTicks intervals in a row
// that were not, and the pages the busy heap grew to are returned to the
// system at once (the runtime's scavenger would return them over minutes,
// and meanwhile they are resident).
type gcTuner struct {
	idle int // the idle target, below busyGCPercent
	// set sets the target and returns the previous one
	// (debug.SetGCPercent); read returns the heap's allocations since
	// the process started and what the last collection left live, in bytes
	// (readHeap).
	set  func(int) int
	read func() (allocs, live uint64)
	// free collects and returns the heap's free memory to the system
	// (debug.FreeOSMemory), once at each return to the idle target.
	free func()

	current    int
	lastAllocs uint64
	lastLive   uint64
	quiet      int
}

// newGCTuner returns a tuner of a process whose target is idle (applied
// by applyGCPercent).
func newGCTuner(idle int) *gcTuner {
	t := &gcTuner{idle: idle, set: debug.SetGCPercent, read: readHeap, free: debug.FreeOSMemory, current: idle}
	t.lastAllocs, t.lastLive = t.read()
	return t
}

// run ticks every gcTuneInterval of clk until ctx ends, then leaves the
// idle target.
func (t *gcTuner) run(ctx context.Context, clk clock.Clock) {
	tk := clk.NewTicker(gcTuneInterval)
	defer tk.Stop()
	defer func() {
		if t.current != t.idle {
			t.set(t.idle)
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C():
			t.tick()
		}
	}
}

// tick reads the heap's growth since the last tick and sets the target.
func (t *gcTuner) tick() {
	allocs, live := t.read()
	grown, settled := allocs-t.lastAllocs, live <= t.lastLive+t.lastLive/gcLiveGrowth
	t.lastAllocs, t.lastLive = allocs, live
	if grown > live*uint64(t.idle)/100 && settled {
		t.quiet = 0
		if t.current != busyGCPercent {
			t.current = busyGCPercent
			t.set(busyGCPercent)
		}
		return
	}
	if t.current == t.idle {
		return
	}
	if t.quiet++; t.quiet >= gcQuietTicks {
		t.quiet = 0
		t.current = t.idle
		t.set(t.idle)
		t.free()
	}
}

// readHeap returns the bytes the heap allocated since the process started
// and the bytes the last collection left live (runtime/metrics).
func readHeap() (allocs, live uint64) {
	s := []rtmetrics.Sample{{Name: "/gc/heap/allocs:bytes"}, {Name: "/gc/heap/live:bytes"}}
	rtmetrics.Read(s)
	return s[0].Value.Uint64(), s[1].Value.Uint64()
}
