// Package clock is the only place that reads the wall clock. Everything else
// takes a Clock, so that the fleet simulator can drive the same code on a
// virtual clock and tests can move time by hand.
//
// To add a time source, implement Clock; Real reads the system clock and Fake
// is moved by hand.
package clock

import (
	"context"
	"sync"
	"time"
)

// Clock tells the time and makes timers.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// NewTimer returns a timer that fires once after d.
	NewTimer(d time.Duration) Timer
	// NewTicker returns a ticker that fires every d (d > 0).
	NewTicker(d time.Duration) Ticker
}

// Timer is a one-shot timer. C delivers the time it fired.
type Timer interface {
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it did so.
	Stop() bool
	// Reset changes the timer to fire after d.
	Reset(d time.Duration)
}

// Ticker fires repeatedly.
type Ticker interface {
	C() <-chan time.Time
	Stop()
	Reset(d time.Duration)
}

// Real is the system clock.
type Real struct{}

// New returns the system clock.
func New() Clock { return Real{} }

// Now returns time.Now().
func (Real) Now() time.Time { return time.Now() }

// NewTimer wraps time.NewTimer.
func (Real) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

// NewTicker wraps time.NewTicker.
func (Real) NewTicker(d time.Duration) Ticker { return realTicker{time.NewTicker(d)} }

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time   { return r.t.C }
func (r realTimer) Stop() bool            { return r.t.Stop() }
func (r realTimer) Reset(d time.Duration) { r.t.Reset(d) }

type realTicker struct{ t *time.Ticker }

func (r realTicker) C() <-chan time.Time   { return r.t.C }
func (r realTicker) Stop()                 { r.t.Stop() }
func (r realTicker) Reset(d time.Duration) { r.t.Reset(d) }

// Since returns c.Now().Sub(t).
func Since(c Clock, t time.Time) time.Duration { return c.Now().Sub(t) }

// Sleep waits for d on c or until ctx is done; it returns ctx.Err() when the
// context ended first.
func Sleep(ctx context.Context, c Clock, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := c.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C():
		return nil
	}
}

// Fake is a clock moved by hand with Advance. It is safe for concurrent use.
type Fake struct {
	mu      sync.Mutex
	now     time.Time
	waiters []*fakeWaiter
}

type fakeWaiter struct {
	at     time.Time
	period time.Duration // 0 for timers
	ch     chan time.Time
	active bool
}

// NewFake returns a Fake clock set to start.
func NewFake(start time.Time) *Fake { return &Fake{now: start} }

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// Advance moves the clock forward by d and fires due timers and tickers.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	for _, w := range f.waiters {
		for w.active && !w.at.After(f.now) {
			select {
			case w.ch <- f.now:
			default:
			}
			if w.period == 0 {
				w.active = false
				break
			}
			w.at = w.at.Add(w.period)
		}
	}
	kept := f.waiters[:0]
	for _, w := range f.waiters {
		if w.active {
			kept = append(kept, w)
		}
	}
	f.waiters = kept
}

// Set moves the clock to t (which must not be before Now) and fires due timers.
func (f *Fake) Set(t time.Time) { f.Advance(t.Sub(f.Now())) }

func (f *Fake) add(w *fakeWaiter) {
	f.mu.Lock()
	defer f.mu.Unlock()
	w.active = true
	f.waiters = append(f.waiters, w)
}

// NewTimer returns a timer that fires when the clock passes Now()+d.
func (f *Fake) NewTimer(d time.Duration) Timer {
	w := &fakeWaiter{at: f.Now().Add(d), ch: make(chan time.Time, 1)}
	f.add(w)
	return &fakeTimer{f: f, w: w}
}

// NewTicker returns a ticker firing every d of fake time.
func (f *Fake) NewTicker(d time.Duration) Ticker {
	w := &fakeWaiter{at: f.Now().Add(d), period: d, ch: make(chan time.Time, 1)}
	f.add(w)
	return tickerAdapter{&fakeTimer{f: f, w: w}}
}

type fakeTimer struct {
	f *Fake
	w *fakeWaiter
}

func (t *fakeTimer) C() <-chan time.Time { return t.w.ch }

func (t *fakeTimer) Stop() bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	was := t.w.active
	t.w.active = false
	return was
}

func (t *fakeTimer) Reset(d time.Duration) {
	t.f.mu.Lock()
	t.w.at = t.f.now.Add(d)
	if t.w.period != 0 {
		t.w.period = d
	}
	t.w.active = true
	for _, w := range t.f.waiters {
		if w == t.w {
			t.f.mu.Unlock()
			return
		}
	}
	t.f.waiters = append(t.f.waiters, t.w)
	t.f.mu.Unlock()
}

func (t *fakeTimer) stopTicker() { t.Stop() }

var _ Ticker = tickerAdapter{}

type tickerAdapter struct{ *fakeTimer }

func (a tickerAdapter) Stop() { a.stopTicker() }
