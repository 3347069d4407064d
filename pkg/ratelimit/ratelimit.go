// Package ratelimit limits what one source address may do per second: a
// token bucket per address (golang.org/x/time/rate), in a map of bounded
// size, and the Connect error (ResourceExhausted, HTTP 429, with a
// Retry-After hint) that a refused call answers.
//
// The API limits failed authentications and ticket issuance with it, and
// JoinService limits joins. The source of a call is its TCP peer (Source);
// X-Forwarded-For is read only when a setting says that a trusted proxy
// writes it. To limit something new, make a Limiter with its own Rate and
// Burst settings, call Allow (or Blocked) with Source's key, and answer
// Error's error when it refuses.
package ratelimit

import (
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/time/rate"

	"github.com/better-compute/better-compute/pkg/clock"
)

// Proxy is the setting, shared by the services that limit per source
// address, that says where a call's source address comes from.
type Proxy struct {
	// TrustForwardedFor makes the source address of the per-address limits
	// (failed authentications, ticket issuance, joins) the last address of
	// a request's X-Forwarded-For header rather than its TCP peer: set it
	// only behind a proxy that appends that header, since a client can
	// write it.
	TrustForwardedFor bool `env:"TRUST_FORWARDED_FOR"`
}

// DefaultMaxKeys is the default Limiter.MaxKeys: 65,536 addresses, a few
// MiB at most.
const DefaultMaxKeys = 1 << 16

// Limiter is a token bucket per key: each key may do Burst things at once,
// and Rate more per second after that. It holds at most MaxKeys keys: a
// key idle long enough for its bucket to fill again is the same as a new
// one, so it is dropped (idle keys are swept at most once per refill time,
// burst/rate), and when every slot is taken by keys that are not idle,
// arbitrary ones are dropped to make room, which lets those start afresh:
// memory stays bounded whatever the number of addresses. Safe for
// concurrent use; make it with New.
type Limiter struct {
	clock   clock.Clock
	limit   rate.Limit
	burst   int
	maxKeys int
	// refill is how long an empty bucket takes to fill: an idle key is
	// dropped after it.
	refill time.Duration

	mu        sync.Mutex
	keys      map[string]*rate.Limiter
	lastSweep time.Time
}

// New returns a Limiter of perSecond things per second per key after a
// burst of burst (both at least 1, else New panics: settings are checked
// before), holding at most maxKeys keys (≤ 0: DefaultMaxKeys), timed by
// clk.
func New(perSecond, burst, maxKeys int, clk clock.Clock) *Limiter {
	if perSecond < 1 || burst < 1 {
		panic(fmt.Sprintf("ratelimit: rate %d/s and burst %d must be at least 1", perSecond, burst))
	}
	if maxKeys <= 0 {
		maxKeys = DefaultMaxKeys
	}
	return &Limiter{clock: clk, limit: rate.Limit(perSecond), burst: burst, maxKeys: maxKeys,
		refill: time.Duration(float64(burst) / float64(perSecond) * float64(time.Second)),
		keys:   make(map[string]*rate.Limiter), lastSweep: clk.Now()}
}

// Allow takes one of key's tokens and reports true, or reports false with
// how long until key has one again (nothing is taken then).
func (l *Limiter) Allow(key string) (ok bool, retryAfter time.Duration) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	lim := l.get(key, now)
	if lim.AllowN(now, 1) {
		return true, 0
	}
	return false, l.wait(lim, now)
}

// Blocked reports whether key has no token left, and how long until it
// has one, without taking any.
func (l *Limiter) Blocked(key string) (blocked bool, retryAfter time.Duration) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	lim := l.keys[key]
	if lim == nil || lim.TokensAt(now) >= 1 {
		return false, 0
	}
	return true, l.wait(lim, now)
}

// Keys returns how many keys the Limiter holds.
func (l *Limiter) Keys() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.keys)
}

// wait is how long until lim has a token at now.
func (l *Limiter) wait(lim *rate.Limiter, now time.Time) time.Duration {
	missing := 1 - lim.TokensAt(now)
	return time.Duration(math.Ceil(missing / float64(l.limit) * float64(time.Second)))
}

// get returns key's bucket, making room for it when it is new.
func (l *Limiter) get(key string, now time.Time) *rate.Limiter {
	if lim := l.keys[key]; lim != nil {
		return lim
	}
	if len(l.keys) >= l.maxKeys || now.Sub(l.lastSweep) >= l.refill {
		l.sweep(now)
	}
	lim := rate.NewLimiter(l.limit, l.burst)
	l.keys[key] = lim
	return lim
}

// sweep drops the idle keys (full buckets) and, when the map is still
// full, arbitrary keys until a quarter of it is free.
func (l *Limiter) sweep(now time.Time) {
	l.lastSweep = now
	for k, lim := range l.keys {
		if lim.TokensAt(now) >= float64(l.burst) {
			delete(l.keys, k)
		}
	}
	if len(l.keys) < l.maxKeys {
		return
	}
	keep := l.maxKeys - max(1, l.maxKeys/4)
	for k := range l.keys { // map order is random: no address is favoured
		if len(l.keys) <= keep {
			break
		}
		delete(l.keys, k)
	}
}

// Source returns the key of a call's source address: its TCP peer
// (remoteAddr, "host:port" as net/http's Request.RemoteAddr and Connect's
// Peer().Addr give it) or, when trustForwarded, the last address of
// header's X-Forwarded-For (the one the trusted proxy in front appended;
// the peer when there is none or it does not parse). An IPv4 address is
// its own key; an IPv6 address is keyed by its /64 prefix, the block one
// host is usually given, so that one host cannot take a new bucket per
// address. Anything else is keyed as it is.
func Source(remoteAddr string, header http.Header, trustForwarded bool) string {
	addr := remoteAddr
	if trustForwarded {
		if values := header.Values("X-Forwarded-For"); len(values) > 0 {
			list := strings.Split(values[len(values)-1], ",")
			if a := strings.TrimSpace(list[len(list)-1]); a != "" {
				if _, err := netip.ParseAddr(a); err == nil {
					addr = a
				}
			}
		}
	}
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return addr
	}
	ip = ip.Unmap().WithZone("")
	if ip.Is4() {
		return ip.String()
	}
	return netip.PrefixFrom(ip, 64).Masked().String()
}

// RetryAfterHeader is the response header of a refusal that says in how
// many seconds to try again (RFC 9110 section 10.2.3).
const RetryAfterHeader = "Retry-After"

// RetrySeconds is retryAfter in whole seconds, rounded up, at least 1: the
// value of RetryAfterHeader.
func RetrySeconds(retryAfter time.Duration) int {
	return max(1, int(math.Ceil(retryAfter.Seconds())))
}

// Error returns the refusal of a call over a limit: ResourceExhausted
// (HTTP 429) "<what> from this address: too many; retry in N s", with
// the Retry-After header set to N (RetrySeconds).
func Error(what string, retryAfter time.Duration) *connect.Error {
	n := RetrySeconds(retryAfter)
	err := connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("%s from this address: too many; retry in %d s", what, n))
	err.Meta().Set(RetryAfterHeader, strconv.Itoa(n))
	return err
}
