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
)

var (
	mu      sync.Mutex
	entropy io.Reader = ulid.Monotonic(rand.Reader, 0)
)

// New returns a new id of kind p made at time t (take t from a clock.Clock).
func New(p Prefix, t time.Time) string {
	mu.Lock()
	defer mu.Unlock()
	return string(p) + "_" + ulid.MustNew(ulid.Timestamp(t), entropy).String()
}

// FromReader returns an id of kind p at time t drawing its randomness from r,
// for deterministic ids in the simulator.
func FromReader(p Prefix, t time.Time, r io.Reader) string {
	return string(p) + "_" + ulid.MustNew(ulid.Timestamp(t), r).String()
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
