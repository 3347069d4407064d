// Package lease elects one holder per role (a reconciler, the scheduler)
// through the leases table: a holder takes a lease for a TTL and renews it
// every TTL/3; when it stops renewing, another holder takes the lease over
// once it has expired. Time is the holders' clocks (the Clock of Lease), so
// the holders' clocks must agree to well within a TTL.
//
// A lease is a performance and tidiness device, not a lock: a holder that
// stalls longer than the TTL may still be running when the next one starts,
// so work done under a lease must also be safe when two holders overlap
// (state transitions guarded in SQL, FOR UPDATE SKIP LOCKED, constraints).
//
// To put a loop behind a lease, wrap its Run in (*Lease).Run.
package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
)

// DefaultTTL is the TTL of a Lease whose TTL is zero.
const DefaultTTL = 15 * time.Second

// Lease is one role's lease as seen by one holder.
type Lease struct {
	// DB holds the leases table.
	DB *store.DB
	// Name is the role, e.g. "controllers.acceptance".
	Name string
	// Holder names this process; it must differ between processes
	// (DefaultHolder makes one).
	Holder string
	// TTL is how long a lease lasts without renewal; DefaultTTL if zero.
	TTL time.Duration
	// Clock stamps leases; DB.Clock if nil.
	Clock clock.Clock
	// Logger receives lease changes; discarded if nil.
	Logger *slog.Logger

	held atomic.Bool
}

// DefaultHolder returns "<hostname>-<8 random hex digits>", unique per
// process.
func DefaultHolder() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

func (l *Lease) ttl() time.Duration {
	if l.TTL > 0 {
		return l.TTL
	}
	return DefaultTTL
}

func (l *Lease) clock() clock.Clock {
	if l.Clock != nil {
		return l.Clock
	}
	return l.DB.Clock
}

func (l *Lease) logger() *slog.Logger {
	if l.Logger != nil {
		return l.Logger
	}
	return slog.New(slog.DiscardHandler)
}

func (l *Lease) now() time.Time { return l.clock().Now().UTC().Truncate(time.Microsecond) }

// Held reports whether this holder held the lease at its last acquisition or
// renewal through Run.
func (l *Lease) Held() bool { return l.held.Load() }

// TryAcquire takes or renews the lease for TTL from now and reports whether
// this holder holds it: true when it was free, expired or already ours,
// false when another holder has it.
func (l *Lease) TryAcquire(ctx context.Context) (bool, error) {
	return store.TryAcquireLease(ctx, l.DB.Pool, l.Name, l.Holder, l.now(), l.ttl())
}

// Release gives the lease up if this holder holds it, so another holder can
// take it without waiting for expiry.
func (l *Lease) Release(ctx context.Context) error {
	l.held.Store(false)
	_, err := store.ReleaseLease(ctx, l.DB.Pool, l.Name, l.Holder)
	return err
}

// tryDetached is TryAcquire with a context that ctx's cancellation does not
// reach, bounded by TTL/3: a query abandoned mid-flight could still take
// the lease on the server after Run released it on shutdown.
func (l *Lease) tryDetached(ctx context.Context) (bool, error) {
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.ttl()/3)
	defer cancel()
	return l.TryAcquire(qctx)
}

// errLost ends one tenure of Run.
var errLost = errors.New("lease lost")

// Run calls fn while this holder holds the lease, until ctx ends. It tries
// to acquire the lease every TTL/3; once it has it, it starts fn and renews
// every TTL/3. When the lease is lost (another holder has it, or renewals
// failed for so long that it may expire before the next one) it cancels fn's
// context, waits for fn to return and goes back to acquiring. When ctx ends
// it cancels fn, waits for it and releases the lease. Run returns nil when
// ctx ends, and fn's result when fn returns by itself while holding the
// lease (after releasing it).
func (l *Lease) Run(ctx context.Context, fn func(ctx context.Context) error) error {
	interval := l.ttl() / 3
	log := l.logger().With("lease", l.Name, "holder", l.Holder)
	for {
		start := l.now()
		ok, err := l.tryDetached(ctx)
		if ctx.Err() != nil {
			if ok {
				l.releaseQuietly(ctx, log)
			}
			return nil
		}
		if err != nil {
			log.Warn("acquire lease failed", "err", err)
		}
		if ok {
			err := l.hold(ctx, log, start.Add(l.ttl()), fn)
			if !errors.Is(err, errLost) {
				return err
			}
		}
		if err := clock.Sleep(ctx, l.clock(), interval); err != nil {
			return nil
		}
	}
}

// hold runs fn while renewing a lease valid until validUntil. It returns
// errLost when the lease was lost, nil when ctx ended, or fn's result.
func (l *Lease) hold(ctx context.Context, log *slog.Logger, validUntil time.Time, fn func(ctx context.Context) error) error {
	l.held.Store(true)
	defer l.held.Store(false)
	log.Info("lease acquired")
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn(fctx) }()

	interval := l.ttl() / 3
	tick := l.clock().NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				log.Warn("leased function ended with an error at shutdown", "err", err)
			}
			l.releaseQuietly(ctx, log)
			return nil
		case err := <-done:
			l.releaseQuietly(ctx, log)
			if ctx.Err() != nil {
				return nil // fn saw ctx end before this select did
			}
			return err
		case <-tick.C():
			start := l.now()
			ok, err := l.tryDetached(ctx)
			switch {
			case ctx.Err() != nil:
				continue // the ctx.Done case releases
			case ok:
				validUntil = start.Add(l.ttl())
				continue
			case err == nil:
				log.Warn("lease lost to another holder")
			case !l.now().Add(interval).Before(validUntil):
				log.Warn("lease renewal failed; giving the lease up before it expires", "err", err)
			default:
				log.Warn("lease renewal failed; retrying", "err", err)
				continue
			}
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				log.Warn("leased function ended with an error after the lease was lost", "err", err)
			}
			l.releaseQuietly(ctx, log) // no-op unless renewals failed while we still held it
			return errLost
		}
	}
}

func (l *Lease) releaseQuietly(ctx context.Context, log *slog.Logger) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := l.Release(rctx); err != nil {
		log.Warn("release lease failed", "err", err)
		return
	}
	log.Info("lease released")
}
