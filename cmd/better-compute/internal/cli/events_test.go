package cli_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/syncbuf"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// syncBuffer is syncbuf.Buffer: safe for concurrent writers and readers.
type syncBuffer = syncbuf.Buffer

// insertEvent writes an event of tenant and returns its id.
func (f *fleet) insertEvent(t *testing.T, tenant, typ string) int64 {
	t.Helper()
	return storetest.Event(t, f.db, &storetest.EventOpts{TenantID: tenant, Type: typ, SubjectID: "node_x", Data: `{"n": 1}`,
		CreatedAt: f.now})
}

// TestEventsWatch runs `events watch` through a proxy that drops its
// connections: the command prints one JSON line per event of the caller's
// tenant and type, reconnects and resumes after the last one printed, with
// no gap and no duplicate.
func TestEventsWatch(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	other := apitest.Tenant(t, f.db, "other")
	proxy, _ := watchProxy(t, f)

	before := f.insertEvent(t, f.tenant, "node.cordoned")
	first := f.insertEvent(t, f.tenant, "node.cordoned")
	f.insertEvent(t, other, "node.cordoned")
	f.insertEvent(t, f.tenant, "reservation.active")
	second := f.insertEvent(t, f.tenant, "node.uncordoned")

	var stdout, stderr syncBuffer
	ctx, cancel := context.WithCancel(t.Context())
	env := map[string]string{"BETTER_COMPUTE_URL": proxy.URL, "BETTER_COMPUTE_TOKEN": apitest.Token(t, f.db, f.tenant, iam.RoleViewer)}
	done := make(chan int, 1)
	go func() {
		done <- cli.Run(ctx, []string{"events", "watch", "--types", "node.*", "--after", strconv.FormatInt(before, 10)},
			cli.Env{Stdout: &stdout, Stderr: &stderr, Getenv: func(k string) string { return env[k] }, Clock: clock.New()})
	}()
	lines := func(n int) []map[string]any {
		t.Helper()
		require.Eventually(t, func() bool { return strings.Count(stdout.String(), "\n") >= n }, 15*time.Second,
			20*time.Millisecond, "want %d lines, have %q (stderr %q)", n, stdout.String(), stderr.String())
		var out []map[string]any
		for _, l := range strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n") {
			var m map[string]any
			require.NoError(t, json.Unmarshal([]byte(l), &m), l)
			out = append(out, m)
		}
		return out
	}
	got := lines(2)
	require.Equal(t, map[string]any{"id": float64(first), "type": "node.cordoned", "tenantId": f.tenant, "subjectId": "node_x",
		"data": map[string]any{"n": float64(1)}, "time": f.now.UTC().Format(time.RFC3339Nano)}, got[0])
	require.Equal(t, float64(second), got[1]["id"])

	// The stream drops twice; events written meanwhile come once each.
	var want []float64
	for i := range 2 {
		proxy.CloseClientConnections()
		require.Eventually(t, func() bool { return strings.Count(stderr.String(), "resuming after event") == i+1 },
			15*time.Second, 20*time.Millisecond, "the drop is noticed")
		want = append(want, float64(f.insertEvent(t, f.tenant, "node.cordoned")))
		f.insertEvent(t, other, "node.cordoned")
		want = append(want, float64(f.insertEvent(t, f.tenant, "node.rebooted")))
		lines(4 + 2*i) // printed: the new stream is up
	}
	got = lines(6)
	var ids []float64
	for _, m := range got[2:] {
		ids = append(ids, m["id"].(float64))
	}
	require.Equal(t, want, ids)
	require.Contains(t, stderr.String(), "resuming after event ")

	cancel()
	require.Equal(t, 0, <-done, "interrupted: exit 0")
	require.Len(t, lines(6), 6, "nothing more")
}

// TestEventsWatchRefused checks that a refused watch ends at once with the
// API's error rather than retrying.
func TestEventsWatchRefused(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	res := f.runner(f.viewer).run(t, "events", "watch", "--types", "Node.*")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "error: invalid_argument: ")
	require.Contains(t, res.stderr, "--types (entry 1): ")
	res = f.runner("bct_bad").run(t, "events", "watch")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "error: unauthenticated: ")
	res = f.runner(f.viewer).run(t, "events", "watch", "--after", "-1")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "--after")
}

// TestEventsWatchRemovedByRetention: a watch resuming after an event that
// retention removed ends at once, with the API's FailedPrecondition naming
// the oldest id kept and a hint to use --from-start, instead of retrying.
func TestEventsWatchRemovedByRetention(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	gone := f.insertEvent(t, f.tenant, "node.cordoned")
	f.insertEvent(t, f.tenant, "node.cordoned")
	n, err := store.DeleteOldEvents(t.Context(), f.db.Pool, f.now.Add(time.Second), 100)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	kept := storetest.Event(t, f.db, &storetest.EventOpts{TenantID: f.tenant, CreatedAt: f.now.Add(time.Hour)})
	res := f.runner(f.viewer).run(t, "events", "watch", "--after", strconv.FormatInt(gone, 10))
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "error: failed_precondition: ")
	require.Contains(t, res.stderr, fmt.Sprintf("--after: events after %d were removed by retention (the oldest event id kept is %d): watch again from the start (--from-start)",
		gone, kept))
	require.Contains(t, res.stderr, "better-compute events watch --from-start")
	require.Equal(t, 1, strings.Count(res.stderr, "\n"), "one line: %q", res.stderr)
}

// TestEventsWatchFromNowResumesWhereItStarted: a watch "from now" (no
// --after) whose stream drops before its first event resumes after the
// newest id when it started (the Bc-Watch-After header), so an event
// written while it reconnects is printed, not skipped as "before now".
func TestEventsWatchFromNowResumesWhereItStarted(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	last := f.insertEvent(t, f.tenant, "node.cordoned")
	proxy, started := watchProxy(t, f)

	var stdout, stderr syncBuffer
	ctx, cancel := context.WithCancel(t.Context())
	env := map[string]string{"BETTER_COMPUTE_URL": proxy.URL, "BETTER_COMPUTE_TOKEN": apitest.Token(t, f.db, f.tenant, iam.RoleViewer)}
	done := make(chan int, 1)
	go func() {
		done <- cli.Run(ctx, []string{"events", "watch", "--types", "node.*"},
			cli.Env{Stdout: &stdout, Stderr: &stderr, Getenv: func(k string) string { return env[k] }, Clock: clock.New()})
	}()
	require.Eventually(t, func() bool { return len(started) > 0 }, 15*time.Second, 20*time.Millisecond,
		"the watch never started")
	proxy.CloseClientConnections()
	require.Eventually(t, func() bool { return strings.Contains(stderr.String(), "resuming after event") },
		15*time.Second, 20*time.Millisecond, "the drop is noticed")
	require.Contains(t, stderr.String(), fmt.Sprintf("resuming after event %d ", last))
	during := f.insertEvent(t, f.tenant, "node.uncordoned") // before the reconnect (500 ms later)
	require.Eventually(t, func() bool { return strings.Contains(stdout.String(), fmt.Sprintf(`"id":%d`, during)) },
		15*time.Second, 20*time.Millisecond, "the event written while reconnecting is printed (stdout %q)", stdout.String())
	cancel()
	require.Equal(t, 0, <-done)
}

// runningWatch is `events watch` running in the background.
type runningWatch struct {
	stdout, stderr syncBuffer
	cancel         context.CancelFunc
	// finished is closed when the command has returned code.
	finished chan struct{}
	code     int
}

// startWatch runs `events watch args…` against url as a viewer of f's
// tenant, with clk; it is interrupted when the test ends.
func startWatch(t *testing.T, f *fleet, url string, clk clock.Clock, args ...string) *runningWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	w := &runningWatch{cancel: cancel, finished: make(chan struct{})}
	env := map[string]string{"BETTER_COMPUTE_URL": url, "BETTER_COMPUTE_TOKEN": apitest.Token(t, f.db, f.tenant, iam.RoleViewer)}
	go func() {
		defer close(w.finished)
		w.code = cli.Run(ctx, append([]string{"events", "watch"}, args...),
			cli.Env{Stdout: &w.stdout, Stderr: &w.stderr, Getenv: func(k string) string { return env[k] }, Clock: clk})
	}()
	t.Cleanup(func() {
		cancel()
		<-w.finished
	})
	return w
}

// interrupt interrupts the command and returns its exit code.
func (w *runningWatch) interrupt() int {
	w.cancel()
	<-w.finished
	return w.code
}

// printed reports whether the watch has printed the event id.
func (w *runningWatch) printed(id int64) bool {
	return strings.Contains(w.stdout.String(), fmt.Sprintf(`"id":%d,`, id))
}

// dropBeforeFirstEvent drops the watch's stream once it has started and
// waits for the command to say it resumes (want in its message); the
// reconnect then waits for clk to move.
func dropBeforeFirstEvent(t *testing.T, w *runningWatch, proxy *httptest.Server, started <-chan struct{}, want string) {
	t.Helper()
	require.Eventually(t, func() bool { return len(started) > 0 }, 15*time.Second, 20*time.Millisecond,
		"the watch never started")
	proxy.CloseClientConnections()
	require.Eventually(t, func() bool { return strings.Contains(w.stderr.String(), "resuming") },
		15*time.Second, 20*time.Millisecond, "the drop is noticed")
	require.Contains(t, w.stderr.String(), want)
	require.Empty(t, w.stdout.String(), "no event before the drop")
}

// TestEventsWatchFromNowOnNoEventsResumesFromStart: a watch "from now" that
// starts when there is no event at all (Bc-Watch-After: 0) and loses its
// stream before its first event resumes from the start, so that an event
// written while it reconnects is printed, not skipped as "before now".
func TestEventsWatchFromNowOnNoEventsResumesFromStart(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	newest, err := store.MaxEventID(t.Context(), f.db.Pool, store.AllTenants)
	require.NoError(t, err)
	require.Zero(t, newest, "no event yet")
	proxy, started := watchProxy(t, f)
	clk := clock.NewFake(f.now) // the reconnect waits until the test moves it
	w := startWatch(t, f, proxy.URL, clk, "--types", "node.*")
	dropBeforeFirstEvent(t, w, proxy, started, "resuming from the oldest retained event in ")
	during := f.insertEvent(t, f.tenant, "node.uncordoned")
	require.Eventually(t, func() bool { clk.Advance(time.Second); return w.printed(during) },
		15*time.Second, 20*time.Millisecond, "the event written while reconnecting is printed (stdout %q, stderr %q)",
		w.stdout.String(), w.stderr.String())
	require.Equal(t, 0, w.interrupt())
}

// TestEventsWatchFromStart: --from-start prints every retained event,
// oldest first, then live ones; a stream that drops before its first event
// resumes from the start again; --from-start and --after are refused
// together.
func TestEventsWatchFromStart(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	first := f.insertEvent(t, f.tenant, "node.cordoned")
	second := f.insertEvent(t, f.tenant, "reservation.active")
	proxy, started := watchProxy(t, f)

	all := startWatch(t, f, f.url, clock.New(), "--from-start")
	require.Eventually(t, func() bool { return all.printed(second) }, 15*time.Second, 20*time.Millisecond,
		"every retained event (stdout %q, stderr %q)", all.stdout.String(), all.stderr.String())
	require.Less(t, strings.Index(all.stdout.String(), fmt.Sprintf(`"id":%d,`, first)),
		strings.Index(all.stdout.String(), fmt.Sprintf(`"id":%d,`, second)), "oldest first")

	// No command.* event yet: the stream drops before its first one.
	clk := clock.NewFake(f.now)
	commands := startWatch(t, f, proxy.URL, clk, "--types", "command.*", "--from-start")
	dropBeforeFirstEvent(t, commands, proxy, started, "resuming from the oldest retained event in ")
	during := f.insertEvent(t, f.tenant, "command.succeeded")
	require.Eventually(t, func() bool { clk.Advance(time.Second); return commands.printed(during) },
		15*time.Second, 20*time.Millisecond, "the event written while reconnecting is printed")
	require.Eventually(t, func() bool { return all.printed(during) }, 15*time.Second, 20*time.Millisecond, "live")

	res := f.runner(f.viewer).run(t, "events", "watch", "--from-start", "--after", strconv.FormatInt(first, 10))
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "[after from-start]")
}

// watchProxy is a proxy of f's API that streams without buffering (tests
// drop its connections with CloseClientConnections); started is signalled
// whenever a Watch's response headers have been flushed to the client.
func watchProxy(t *testing.T, f *fleet) (proxy *httptest.Server, started <-chan struct{}) {
	t.Helper()
	target, err := url.Parse(f.url)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.FlushInterval = -1
	flushed := make(chan struct{}, 1)
	proxy = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/Watch") {
			w = &flushSignal{ResponseWriter: w, flushed: flushed}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(proxy.Close)
	return proxy, flushed
}

// flushSignal is a ResponseWriter that signals flushed on its first Flush.
type flushSignal struct {
	http.ResponseWriter
	flushed chan struct{}
}

func (f *flushSignal) Flush() {
	f.ResponseWriter.(http.Flusher).Flush()
	select {
	case f.flushed <- struct{}{}:
	default:
	}
}

// ended waits up to 15 s for the command to return, and returns its code.
func (w *runningWatch) ended(t *testing.T) int {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case <-w.finished:
			return true
		default:
			return false
		}
	}, 15*time.Second, 20*time.Millisecond, "the command goes on (stdout %q, stderr %q)", w.stdout.String(), w.stderr.String())
	return w.code
}

// TestEventsWatchRefusesWhatMatchesNothing: a type pattern that matches no
// event type, and an --after above the newest event id, are refused by the
// API at once (exit 1, the field named) rather than watched for ever.
func TestEventsWatchRefusesWhatMatchesNothing(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	newest := f.insertEvent(t, f.tenant, "node.cordoned")

	bogus := startWatch(t, f, f.url, clock.New(), "--types", "node.*,bogus")
	require.Equal(t, 1, bogus.ended(t))
	require.Contains(t, bogus.stderr.String(), `error: invalid_argument: --types (entry 2): "bogus" matches no event type`)
	require.Contains(t, bogus.stderr.String(), "command.*, node.*, reservation.*")

	beyond := startWatch(t, f, f.url, clock.New(), "--after", "99999999")
	require.Equal(t, 1, beyond.ended(t))
	require.Contains(t, beyond.stderr.String(),
		fmt.Sprintf("error: invalid_argument: --after: 99999999 is above the newest event id, %d", newest))

	// Empty entries are ignored: node.* alone.
	ok := startWatch(t, f, f.url, clock.New(), "--types", "node.*,,", "--from-start")
	require.Eventually(t, func() bool { return ok.printed(newest) }, 15*time.Second, 20*time.Millisecond,
		"stdout %q, stderr %q", ok.stdout.String(), ok.stderr.String())
	require.Equal(t, 0, ok.interrupt())
}

// TestEventsWatchQuietStreamResetsBackoff: a watch whose streams drop
// without an event (a filter that matches nothing that happens) waits the
// first reconnect delay after each drop, not a doubling one: every stream
// that was established resets the backoff, not only a printed event. The
// drops also read as a lost connection (unavailable), not as connect-go's
// "internal: protocol error".
func TestEventsWatchQuietStreamResetsBackoff(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	proxy, started := watchProxy(t, f)
	clk := clock.NewFake(f.now) // a reconnect waits until the test moves it
	w := startWatch(t, f, proxy.URL, clk, "--types", "node.*")
	timer := clock.New().NewTimer(15 * time.Second)
	defer timer.Stop()
	for i := range 3 {
		select { // a stream is established: its headers were flushed
		case <-started:
		case <-timer.C():
			t.Fatalf("stream %d never started (stderr %q)", i+1, w.stderr.String())
		}
		proxy.CloseClientConnections()
		require.Eventually(t, func() bool { return strings.Count(w.stderr.String(), "resuming") == i+1 },
			15*time.Second, 20*time.Millisecond, "drop %d is noticed", i+1)
		lines := strings.Split(strings.TrimSuffix(w.stderr.String(), "\n"), "\n")
		last := lines[len(lines)-1]
		require.True(t, strings.HasSuffix(last, " in 500ms"), "drop %d: %q", i+1, last)
		// Move the clock until the next stream starts.
		require.Eventually(t, func() bool { clk.Advance(100 * time.Millisecond); return len(started) > 0 },
			15*time.Second, 20*time.Millisecond, "reconnect %d", i+1)
	}
	require.Empty(t, w.stdout.String())
	require.Equal(t, 0, w.interrupt())
	for _, l := range strings.Split(strings.TrimSuffix(w.stderr.String(), "\n"), "\n") {
		require.True(t, strings.HasPrefix(l, "events watch: unavailable: lost the connection to the API server: "), l)
	}
}

// TestEventsWatchHelp: the help says where a reconnect before the first
// event resumes, as README does: after the Bc-Watch-After id, or from the
// start when it is 0.
func TestEventsWatchHelp(t *testing.T) {
	t.Parallel()
	res := runner{}.run(t, "events", "watch", "--help")
	require.Equal(t, 0, res.code, res.stderr)
	help := strings.Join(strings.Fields(res.stdout), " ")
	require.Contains(t, help, "Before the first event printed, it resumes after the id the stream started after, "+
		"which the server names in the Bc-Watch-After response header")
	require.Contains(t, help, "or from the start when that is 0")
	require.NotContains(t, help, "now again")
}

// TestResumePoint: the reconnect message says where the watch starts again;
// a watch from now that never got a stream does not claim to resume "after
// event 0", which reads as a replay from the start.
func TestResumePoint(t *testing.T) {
	t.Parallel()
	for req, want := range map[*computev1.WatchRequest]string{
		{}:                "from now (no stream has started yet)",
		{AfterId: 42}:     "after event 42",
		{FromStart: true}: "from the oldest retained event",
	} {
		require.Equal(t, want, cli.ResumePoint(req))
	}
}
