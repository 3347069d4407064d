// Package ids makes the typed, prefixed identifiers of better-compute:
// "node_01J…", "pool_…", "res_…", "ten_…", "cmd_…". The part after the prefix
// is a ULID (26 characters of Crockford base32), so ids sort by creation time.
//
// To add a kind, add a Prefix constant.
package ids

import (
	"crypto/rand"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/oklog/ulid/v2"
)

// Prefix is the kind of an id, written before its underscore.
type Prefix string

// The kinds of id.
const (
	Node        Prefix = "node"
	Pool        Prefix = "pool"
	Site        Prefix = "site"
	Tenant      Prefix = "ten"
	APIToken    Prefix = "tok"
	JoinToken   Prefix = "jt"
	Command     Prefix = "cmd"
	Reservation Prefix = "res"
	Session     Prefix = "ses"
	Gateway     Prefix = "gw"
	Event       Prefix = "evt"
	Ticket      Prefix = "tkt"
)

// recentSlots is how many milliseconds New remembers its last id of.
const recentSlots = 64

var (
	mu sync.Mutex
	// recent holds, per slot (a millisecond modulo recentSlots), the last id
	// New made in that millisecond: the next id of the same millisecond is
	// that one plus one, so ids made in one process sort in the order they
	// were made within a millisecond even when ids of other milliseconds are
	// made in between (ulid.Monotonic forgets as soon as the millisecond
	// changes: goroutines whose clock readings interleave, or tests on fake
	// clocks running in parallel, got same-millisecond ids in random order).
	// A millisecond is forgotten when one of the same slot takes its place,
	// so the order holds while fewer than recentSlots milliseconds pass in
	// between, as it does between a clock's readings close in time.
	recent [recentSlots]struct {
		ms   uint64
		last ulid.ULID
		set  bool
	}
)

// New returns a new id of kind p made at time t (take t from a clock.Clock).
func New(p Prefix, t time.Time) string {
	ms := ulid.Timestamp(t)
	mu.Lock()
	defer mu.Unlock()
	slot := &recent[ms%recentSlots]
	var id ulid.ULID
	if slot.set && slot.ms == ms && increment(&slot.last) {
		id = slot.last
	} else {
		id = ulid.MustNew(ms, rand.Reader)
	}
	slot.ms, slot.last, slot.set = ms, id, true
	return string(p) + "_" + id.String()
}

// increment adds one to id's 80 bits of entropy (bytes 6 to 15, big-endian)
// and reports false, leaving it unchanged, when they would overflow.
func increment(id *ulid.ULID) bool {
	for i := len(id) - 1; i >= 6; i-- {
		if id[i] != 0xff {
			id[i]++
			for j := i + 1; j < len(id); j++ {
				id[j] = 0
			}
			return true
		}
	}
	return false
}

// FromReader returns an id of kind p at time t drawing its randomness from r,
// for deterministic ids in the simulator.
func FromReader(p Prefix, t time.Time, r io.Reader) string {
	return string(p) + "_" + ulid.MustNew(ulid.Timestamp(t), r).String()
}

// Floor returns the lowest id of kind p made at t's millisecond: every id
// of kind p that New or FromReader makes at t or later sorts at or above it
// (as strings, byte by byte), every one made at an earlier millisecond below
// it. It is a bound for a range of ids by creation time (e.g. id < Floor(p,
// t): the ids made before t's millisecond), not an id anything has.
func Floor(p Prefix, t time.Time) string {
	var id ulid.ULID // entropy zero
	if err := id.SetTime(ulid.Timestamp(t)); err != nil {
		// Past ulid.MaxTime (year 10889): no id sorts above every id.
		return string(p) + "_" + ulid.ULID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
			0xff, 0xff, 0xff, 0xff}.String()
	}
	return string(p) + "_" + id.String()
}

// Check returns an error unless s is a well-formed id of kind p. The error
// names the expected prefix.
func Check(p Prefix, s string) error {
	rest, ok := strings.CutPrefix(s, string(p)+"_")
	if !ok {
		return fmt.Errorf("must start with %q", string(p)+"_")
	}
	if _, err := ulid.ParseStrict(rest); err != nil {
		return fmt.Errorf("malformed %s id", p)
	}
	return nil
}
