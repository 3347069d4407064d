// Package batch groups concurrent calls into batches, so that many callers
// share one database round trip and one commit (group commit).
//
// A Batcher runs Workers goroutines. Each takes the first waiting call, then
// every other call already waiting, up to MaxBatch, and hands them to the
// flush function together. There is no timer: a call that finds an idle
// worker is flushed at once, alone, and calls batch up only while every
// worker is busy, so latency stays that of one flush when the load is low
// and the batches grow with the load.
//
// To batch a new kind of write, write a flush function that does the whole
// batch in one transaction and answers each item apart (a per-item error
// belongs in R), and call Do from the request path.
package batch

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// ErrClosed is returned by Do once Close was called.
var ErrClosed = errors.New("batch: closed")

// Flush writes items and returns one result per item, in their order, or an
// error that fails every item. ctx is the batcher's, bounded by
// Options.Timeout, not a caller's.
type Flush[T, R any] func(ctx context.Context, items []T) ([]R, error)

// Options tune a Batcher.
type Options struct {
	// Workers is how many flushes may run at once (default 4): the
	// database connections the batcher keeps busy.
	Workers int
	// MaxBatch is the most items one flush takes (default 256).
	MaxBatch int
	// Timeout bounds one flush (default 10 s).
	Timeout time.Duration
}

type call[T, R any] struct {
	ctx  context.Context
	item T
	res  R
	err  error
	done chan struct{}
}

// Batcher batches the calls of Do into calls of its Flush. Its methods are
// safe for concurrent use.
type Batcher[T, R any] struct {
	flush Flush[T, R]
	opts  Options
	calls chan *call[T, R]
	stop  chan struct{}
	base  context.Context
	halt  context.CancelFunc
	once  sync.Once
	wg    sync.WaitGroup
	// waiting counts the calls of Do waiting for a worker.
	waiting atomic.Int64
}

// New starts a Batcher of flush; Close stops it.
func New[T, R any](flush Flush[T, R], opts Options) *Batcher[T, R] {
	if opts.Workers <= 0 {
		opts.Workers = 4
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 256
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	base, halt := context.WithCancel(context.Background())
	b := &Batcher[T, R]{flush: flush, opts: opts, calls: make(chan *call[T, R]), stop: make(chan struct{}),
		base: base, halt: halt}
	b.wg.Add(opts.Workers)
	for range opts.Workers {
		go b.work()
	}
	return b
}

// Do hands item to the next flush and returns its result. It returns
// ctx.Err() when ctx ends first: the item may then still be flushed (as a
// request whose answer was lost), unless its flush had not begun. It
// returns ErrClosed after Close.
func (b *Batcher[T, R]) Do(ctx context.Context, item T) (R, error) {
	var zero R
	c, err := b.enqueue(ctx, item)
	if err != nil {
		return zero, err
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		return zero, ctx.Err()
	}
}

// enqueue hands item to a worker, or returns ctx.Err() or ErrClosed when
// none took it.
func (b *Batcher[T, R]) enqueue(ctx context.Context, item T) (*call[T, R], error) {
	c := &call[T, R]{ctx: ctx, item: item, done: make(chan struct{})}
	b.waiting.Add(1)
	defer b.waiting.Add(-1)
	select {
	case b.calls <- c:
		return c, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-b.stop:
		return nil, ErrClosed
	}
}

// DoSettled is Do for a write whose caller must know whether it happened:
// once a flush took item it waits for that flush's end (at most
// Options.Timeout), whatever ctx does, and returns its result. So ctx.Err()
// means that item was not flushed, and a flush's error, from a flush that
// writes in one transaction, that it was not written. It returns ErrClosed
// after Close.
func (b *Batcher[T, R]) DoSettled(ctx context.Context, item T) (R, error) {
	c, err := b.enqueue(ctx, item)
	if err != nil {
		var zero R
		return zero, err
	}
	// run answers a call whose ctx ended before its flush began with
	// ctx.Err(), without flushing it.
	<-c.done
	return c.res, c.err
}

// Waiting returns how many calls of Do wait for a worker to take them: the
// size of the next batches.
func (b *Batcher[T, R]) Waiting() int { return int(b.waiting.Load()) }

// Close stops the workers after the flushes in progress, which it cancels,
// and waits for them. Calls of Do that no worker took return ErrClosed.
func (b *Batcher[T, R]) Close() {
	b.once.Do(func() {
		close(b.stop)
		b.halt()
	})
	b.wg.Wait()
}

func (b *Batcher[T, R]) work() {
	defer b.wg.Done()
	batch := make([]*call[T, R], 0, b.opts.MaxBatch)
	for {
		select {
		case <-b.stop:
			return
		case c := <-b.calls:
			batch = append(batch[:0], c)
		}
	more:
		for len(batch) < b.opts.MaxBatch {
			select {
			case c := <-b.calls:
				batch = append(batch, c)
			default:
				break more
			}
		}
		b.run(batch)
		clear(batch)
	}
}

// run flushes the calls of batch whose callers still wait.
func (b *Batcher[T, R]) run(batch []*call[T, R]) {
	live := batch[:0:0]
	items := make([]T, 0, len(batch))
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.err = err
			close(c.done)
			continue
		}
		live = append(live, c)
		items = append(items, c.item)
	}
	if len(live) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(b.base, b.opts.Timeout)
	res, err := b.flush(ctx, items)
	cancel()
	if err == nil && len(res) != len(items) {
		err = fmt.Errorf("batch: flush returned %d results for %d items", len(res), len(items))
	}
	for i, c := range live {
		if err != nil {
			c.err = err
		} else {
			c.res = res[i]
		}
		close(c.done)
	}
}
