package cli

import (
	"context"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
)

// pollWhile re-reads a resource with get every interval while open(cur)
// holds, and returns the last value read. With a non-zero deadline it stops
// there too and reports timedOut; errors of get and a cancelled ctx end it.
func pollWhile[T any](ctx context.Context, clk clock.Clock, interval time.Duration, deadline time.Time, cur T,
	open func(T) bool, get func(context.Context) (T, error)) (last T, timedOut bool, err error) {
	for open(cur) {
		if !deadline.IsZero() && !clk.Now().Before(deadline) {
			return cur, true, nil
		}
		if err := clock.Sleep(ctx, clk, interval); err != nil {
			return cur, false, err
		}
		if cur, err = get(ctx); err != nil {
			return cur, false, err
		}
	}
	return cur, false, nil
}
