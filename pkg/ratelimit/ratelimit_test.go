package ratelimit_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ratelimit"
)

// TestLimiterBurstThenRate checks the burst, the refill rate, the retry
// hint and that keys are limited apart.
func TestLimiterBurstThenRate(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	l := ratelimit.New(10, 50, 0, clk)
	for i := range 50 {
		ok, _ := l.Allow("a")
		require.True(t, ok, "call %d of the burst", i)
	}
	ok, retry := l.Allow("a")
	require.False(t, ok)
	require.Equal(t, 100*time.Millisecond, retry)
	blocked, retry := l.Blocked("a")
	require.True(t, blocked)
	require.Equal(t, 100*time.Millisecond, retry)
	ok, _ = l.Allow("b")
	require.True(t, ok, "another address has its own bucket")
	blocked, _ = l.Blocked("c")
	require.False(t, blocked, "an unseen address is not blocked")

	clk.Advance(time.Second)
	for i := range 10 {
		ok, _ := l.Allow("a")
		require.True(t, ok, "call %d after a second", i)
	}
	ok, _ = l.Allow("a")
	require.False(t, ok, "10 a second")
}

// TestLimiterBoundedMemory checks that idle keys are dropped and that the
// map never holds more than MaxKeys keys.
func TestLimiterBoundedMemory(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	l := ratelimit.New(10, 5, 100, clk)
	for i := range 1000 {
		l.Allow(fmt.Sprint("busy-", i))
		require.LessOrEqual(t, l.Keys(), 100)
	}
	// Refilled (5 tokens at 10/s: half a second): every key is idle, and
	// the next new key sweeps them.
	clk.Advance(time.Second)
	l.Allow("new")
	require.Equal(t, 1, l.Keys())

	// A key spent and then idle until refilled starts afresh.
	for range 5 {
		l.Allow("new")
	}
	ok, _ := l.Allow("new")
	require.False(t, ok)
	clk.Advance(400 * time.Millisecond)
	for range 3 {
		l.Allow("other") // no sweep yet: one is due once per refill time
	}
	require.Equal(t, 2, l.Keys())
	clk.Advance(100 * time.Millisecond)
	l.Allow("third") // sweeps: "new" is full again, "other" is not
	require.Equal(t, 2, l.Keys())
	blocked, _ := l.Blocked("new")
	require.False(t, blocked, "dropped when full again: it starts afresh")
}

func TestSource(t *testing.T) {
	t.Parallel()
	fwd := http.Header{"X-Forwarded-For": {"203.0.113.9, 198.51.100.7"}}
	for _, c := range []struct {
		name, remote string
		header       http.Header
		trust        bool
		want         string
	}{
		{"ipv4 peer", "192.0.2.1:5555", nil, false, "192.0.2.1"},
		{"ipv6 peer by /64", "[2001:db8:1:2:3:4:5:6]:443", nil, false, "2001:db8:1:2::/64"},
		{"mapped ipv4", "[::ffff:192.0.2.1]:1", nil, false, "192.0.2.1"},
		{"forwarded ignored", "192.0.2.1:5555", fwd, false, "192.0.2.1"},
		{"forwarded trusted: the last hop", "192.0.2.1:5555", fwd, true, "198.51.100.7"},
		{"forwarded junk: the peer", "192.0.2.1:5555", http.Header{"X-Forwarded-For": {"nonsense"}}, true, "192.0.2.1"},
		{"not an address", "pipe", nil, false, "pipe"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, c.want, ratelimit.Source(c.remote, c.header, c.trust))
		})
	}
}

func TestError(t *testing.T) {
	t.Parallel()
	err := ratelimit.Error("joins", 1500*time.Millisecond)
	require.Equal(t, connect.CodeResourceExhausted, err.Code())
	require.Equal(t, "joins from this address: too many; retry in 2 s", err.Message())
	require.Equal(t, "2", err.Meta().Get(ratelimit.RetryAfterHeader))
	require.Equal(t, "1", ratelimit.Error("x", 0).Meta().Get(ratelimit.RetryAfterHeader))
}
