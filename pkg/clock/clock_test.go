package clock_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

var start = time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC)

func fired(c <-chan time.Time) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func TestFakeTimerFiresOnlyWhenDue(t *testing.T) {
	f := clock.NewFake(start)
	tm := f.NewTimer(10 * time.Second)
	f.Advance(9 * time.Second)
	require.False(t, fired(tm.C()))
	f.Advance(time.Second)
	require.True(t, fired(tm.C()))
	f.Advance(time.Minute)
	require.False(t, fired(tm.C()), "a timer fires once")
	require.Equal(t, start.Add(70*time.Second), f.Now())
}

func TestFakeTimerStopAndReset(t *testing.T) {
	f := clock.NewFake(start)
	tm := f.NewTimer(time.Second)
	require.True(t, tm.Stop())
	require.False(t, tm.Stop(), "already stopped")
	f.Advance(time.Hour)
	require.False(t, fired(tm.C()))

	tm.Reset(5 * time.Second)
	tm.Reset(5 * time.Second) // a second reset must not register it twice
	f.Advance(5 * time.Second)
	require.True(t, fired(tm.C()))
	f.Advance(5 * time.Second)
	require.False(t, fired(tm.C()))
}

func TestFakeTickerFiresEveryPeriod(t *testing.T) {
	f := clock.NewFake(start)
	tk := f.NewTicker(2 * time.Second)
	n := 0
	for range 5 {
		f.Advance(2 * time.Second)
		if fired(tk.C()) {
			n++
		}
	}
	require.Equal(t, 5, n)
	tk.Stop()
	f.Advance(10 * time.Second)
	require.False(t, fired(tk.C()))
}

func TestSleepReturnsOnCancel(t *testing.T) {
	f := clock.NewFake(start)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- clock.Sleep(ctx, f, time.Hour) }()
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
}

func TestSleepWakesWhenAdvanced(t *testing.T) {
	f := clock.NewFake(start)
	done := make(chan error, 1)
	go func() { done <- clock.Sleep(t.Context(), f, time.Minute) }()
	require.Eventually(t, func() bool {
		f.Advance(time.Minute)
		select {
		case err := <-done:
			require.NoError(t, err)
			return true
		default:
			return false
		}
	}, 5*time.Second, time.Millisecond)
	require.Equal(t, time.Duration(0), clock.Since(f, f.Now()))
}
