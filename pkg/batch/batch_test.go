package batch_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/better-compute/better-compute/pkg/batch"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	testWait = 5 * time.Second
	testTick = time.Millisecond
)

// TestBatchesWhileBusy holds the only worker in a flush while more calls
// arrive: they are flushed together in one batch, each with its own result.
func TestBatchesWhileBusy(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var sizes []int
	b := batch.New(func(_ context.Context, items []int) ([]int, error) {
		mu.Lock()
		sizes = append(sizes, len(items))
		first := len(sizes) == 1
		mu.Unlock()
		if first {
			<-release
		}
		out := make([]int, len(items))
		for i, v := range items {
			out[i] = v * 10
		}
		return out, nil
	}, batch.Options{Workers: 1, MaxBatch: 100})
	defer b.Close()

	first := make(chan int)
	go func() {
		v, _ := b.Do(t.Context(), 1)
		first <- v
	}()
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(sizes) == 1 }, testWait, testTick)

	const n = 20
	results := make([]int, n)
	var wg sync.WaitGroup
	var waiting sync.WaitGroup
	waiting.Add(n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			waiting.Done()
			v, err := b.Do(t.Context(), 100+i)
			require.NoError(t, err)
			results[i] = v
		}()
	}
	waiting.Wait()
	// Let every goroutine reach its send before the worker is freed.
	require.Eventually(t, func() bool { return b.Waiting() == n }, testWait, testTick)
	close(release)
	wg.Wait()
	require.Equal(t, 10, <-first)
	for i, v := range results {
		require.Equal(t, (100+i)*10, v)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, 1, sizes[0])
	total := 0
	for _, s := range sizes[1:] {
		total += s
	}
	require.Equal(t, n, total)
	require.Less(t, len(sizes)-1, n, "the calls that waited were flushed in fewer batches than calls: %v", sizes)
}

func TestFlushErrorFailsTheBatch(t *testing.T) {
	boom := errors.New("boom")
	b := batch.New(func(context.Context, []string) ([]string, error) { return nil, boom }, batch.Options{})
	defer b.Close()
	_, err := b.Do(t.Context(), "x")
	require.ErrorIs(t, err, boom)
}

func TestWrongResultCountIsAnError(t *testing.T) {
	b := batch.New(func(context.Context, []string) ([]string, error) { return nil, nil }, batch.Options{})
	defer b.Close()
	_, err := b.Do(t.Context(), "x")
	require.ErrorContains(t, err, "0 results for 1 items")
}

// TestCanceledCallIsNotFlushed: a call whose context ended before its flush
// began fails with the context's error and is left out of every batch,
// whether a worker took it or not.
func TestCanceledCallIsNotFlushed(t *testing.T) {
	var mu sync.Mutex
	var flushed []string
	b := batch.New(func(_ context.Context, items []string) ([]string, error) {
		mu.Lock()
		flushed = append(flushed, items...)
		mu.Unlock()
		return items, nil
	}, batch.Options{Workers: 2})
	defer b.Close()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	for range 100 {
		_, err := b.Do(ctx, "gone")
		require.ErrorIs(t, err, context.Canceled)
	}
	v, err := b.Do(t.Context(), "after")
	require.NoError(t, err)
	require.Equal(t, "after", v)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"after"}, flushed)
}

func TestDoAfterClose(t *testing.T) {
	b := batch.New(func(_ context.Context, items []int) ([]int, error) { return items, nil }, batch.Options{})
	b.Close()
	_, err := b.Do(t.Context(), 1)
	require.ErrorIs(t, err, batch.ErrClosed)
}

// TestDoSettledWaitsForItsFlush: a caller whose context ends while its item
// is being flushed gets the flush's result from DoSettled, so it knows the
// item was written, where Do returns the context's error.
func TestDoSettledWaitsForItsFlush(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	b := batch.New(func(_ context.Context, items []string) ([]string, error) {
		close(started)
		<-release
		return items, nil
	}, batch.Options{Workers: 1})
	defer b.Close()
	ctx, cancel := context.WithCancel(t.Context())
	type answer struct {
		v   string
		err error
	}
	got := make(chan answer, 1)
	go func() {
		v, err := b.DoSettled(ctx, "written")
		got <- answer{v, err}
	}()
	<-started
	cancel()
	close(release)
	require.Equal(t, answer{v: "written"}, <-got)

	// One whose context ended before a flush took it is not flushed.
	_, err := b.DoSettled(ctx, "gone")
	require.ErrorIs(t, err, context.Canceled)
}
