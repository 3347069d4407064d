package sim

import (
	"container/heap"
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// evKind says what an event does when its time comes.
type evKind uint8

const (
	evTick          evKind = iota + 1 // a node's Agent timer (n is the timer token)
	evStart                           // a node's daemon process starts (n: 1 when the machine rebooted)
	evConnected                       // a dial completed its handshake
	evDialFailed                      // a dial timed out or was refused
	evUp                              // a message reaches a gateway
	evDown                            // a message reaches a node
	evNodeReset                       // the node's transport notices its connection ended
	evGatewayReset                    // a gateway notices a connection ended
	evWorkload                        // the workload's 2-second beat
	evFaults                          // a fault draw
	evStubTick                        // the stub's 1-second beat (expiry, sweeper, resync, usage)
	evGatewayRevive                   // a killed gateway is back (n is its index)
	evHeal                            // a node's partition, isolation or stall ends (log only)
	evExpire                          // a booking reaches its end
)

// event is one scheduled happening. Only the fields of its kind are set.
type event struct {
	at   time.Duration // since the start of the run
	seq  uint64        // tie-breaker: the order events were scheduled in
	kind evKind
	node int32
	n    uint64
	c    *conn
	up   *gatewayv1.SessionRequest
	down *gatewayv1.SessionResponse
	b    *booking
	text string
}

// eventHeap orders events by time, then by the order they were scheduled,
// so that the same inputs always pop in the same order.
type eventHeap []*event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(*event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}

// engine is the discrete-event scheduler on the virtual clock: now only
// moves when an event pops. Events are recycled through a free list, so a
// steady run allocates none for scheduling.
type engine struct {
	now    time.Duration
	seq    uint64
	h      eventHeap
	free   []*event
	popped int64
}

// schedule adds ev to happen at t (never before now).
func (e *engine) schedule(t time.Duration, ev event) {
	t = max(t, e.now)
	var p *event
	if n := len(e.free); n > 0 {
		p = e.free[n-1]
		e.free = e.free[:n-1]
	} else {
		p = new(event)
	}
	*p = ev
	p.at, p.seq = t, e.seq
	e.seq++
	heap.Push(&e.h, p)
}

// next pops the earliest event and moves the clock to it; nil when none is
// left. Release it with recycle after use.
func (e *engine) next() *event {
	if len(e.h) == 0 {
		return nil
	}
	p := heap.Pop(&e.h).(*event)
	e.now = p.at
	e.popped++
	return p
}

func (e *engine) recycle(p *event) {
	*p = event{}
	e.free = append(e.free, p)
}

// newRand returns the run's one generator: PCG seeded from SHA-256 of seed.
func newRand(seed string) *rand.Rand {
	sum := sha256.Sum256([]byte(seed))
	return rand.New(rand.NewPCG(binary.BigEndian.Uint64(sum[0:8]), binary.BigEndian.Uint64(sum[8:16])))
}

// newPCG returns a generator seeded from two draws of r (a node's own
// stream).
func newPCG(r *rand.Rand) *rand.Rand { return rand.New(rand.NewPCG(r.Uint64(), r.Uint64())) }

// randReader reads bytes from a *rand.Rand, for deterministic ids
// (ids.FromReader).
type randReader struct{ r *rand.Rand }

func (rr randReader) Read(p []byte) (int, error) {
	for i := 0; i < len(p); i += 8 {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], rr.r.Uint64())
		copy(p[i:], b[:])
	}
	return len(p), nil
}

// uniform returns a duration drawn uniformly from [lo, hi].
func uniform(r *rand.Rand, lo, hi time.Duration) time.Duration {
	if hi <= lo {
		return lo
	}
	return lo + time.Duration(r.Int64N(int64(hi-lo)+1))
}
