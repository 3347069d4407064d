package api_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/services/api/api"
)

// ended returns the error s ended with (events it sends meanwhile are
// dropped), failing when it goes on for 10 s.
func (s *eventStream) ended(t *testing.T) error {
	t.Helper()
	timer := clock.New().NewTimer(10 * time.Second)
	defer timer.Stop()
	for {
		select {
		case _, ok := <-s.events:
			if !ok {
				return <-s.done
			}
		case <-timer.C():
			t.Fatal("the watch goes on after 10s")
			return nil
		}
	}
}

// lineStream is a running GET WatchPath: its lines, decoded; lines is
// closed at the end of the body.
type lineStream struct{ lines chan map[string]any }

// watchLines GETs WatchPath?q with token; the request ends with the test.
func watchLines(t *testing.T, base, token string, q url.Values) *lineStream {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+api.WatchPath+"?"+q.Encode(), nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	res, err := http.DefaultClient.Do(req) //nolint:bodyclose // the reading goroutine below closes it
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode)
	s := &lineStream{lines: make(chan map[string]any, 100)}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		defer close(s.lines)
		defer res.Body.Close()
		sc := bufio.NewScanner(res.Body)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) != nil {
				m = map[string]any{"unparsed": sc.Text()}
			}
			select {
			case s.lines <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-finished
	})
	return s
}

// next returns the next line, or nil at the end of the body, failing after
// 10 s.
func (s *lineStream) next(t *testing.T) map[string]any {
	t.Helper()
	timer := clock.New().NewTimer(10 * time.Second)
	defer timer.Stop()
	select {
	case m := <-s.lines:
		return m
	case <-timer.C():
		t.Fatal("no line within 10s")
		return nil
	}
}

// requireEnd checks that the next line of s is the error {code, message
// containing contains} and that the body ends after it.
func (s *lineStream) requireEnd(t *testing.T, code connect.Code, contains string) {
	t.Helper()
	m := s.next(t)
	require.NotNil(t, m, "an error line before the end")
	require.Equal(t, code.String(), m["code"], "%v", m)
	require.Contains(t, m["message"], contains)
	require.NotContains(t, m, "id")
	require.Nil(t, s.next(t), "the body ends")
}

// TestWatchEndsWhenTokenRevoked checks that an open watch, on both paths,
// ends with Unauthenticated soon after its token is revoked through the
// API, and that a watch with another token goes on.
func TestWatchEndsWhenTokenRevoked(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	gone, row, err := iam.MintAPIToken(ctx, f.db.Pool, now, f.acme, "doomed", iam.RoleViewer, nil)
	require.NoError(t, err)
	start := mark(t, f.db, f.acme)
	conn := watch(t, f.as(gone), &computev1.WatchRequest{AfterId: start})
	lines := watchLines(t, f.url, gone, url.Values{"after": {strconv.FormatInt(start, 10)}})
	kept := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	e1 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	require.Equal(t, e1, conn.next(t).Id)
	require.Equal(t, float64(e1), lines.next(t)["id"])
	require.Equal(t, e1, kept.next(t).Id)

	_, err = f.as(f.tokens["acme-admin"]).apiTokens.RevokeToken(ctx,
		connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: row.ID}))
	require.NoError(t, err)
	requireCode(t, conn.ended(t), connect.CodeUnauthenticated, "api token was revoked")
	lines.requireEnd(t, connect.CodeUnauthenticated, "api token was revoked")

	// The other token's watch has been checked as often, and goes on.
	e2 := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.Equal(t, e2, kept.next(t).Id)
}

// TestWatchEndsAtExpiry checks that a watch with a token that expires goes
// on until the expiry (by the server's clock, here a fake one) and ends
// with Unauthenticated then, on both paths, while a watch with a token that
// never expires goes on.
func TestWatchEndsAtExpiry(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	clk := clock.NewFake(now)
	f = f.withServer(t, api.WatchConfig{}, nil, clk)
	exp := now.Add(time.Minute)
	short, _, err := iam.MintAPIToken(ctx, f.db.Pool, now, f.acme, "short", iam.RoleViewer, &exp)
	require.NoError(t, err)
	start := mark(t, f.db, f.acme)
	// The first event comes from the first read, before any tick (the
	// fake clock stands still): once it is there, the watches' timers are
	// set.
	e1 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	conn := watch(t, f.as(short), &computev1.WatchRequest{AfterId: start})
	lines := watchLines(t, f.url, short, url.Values{"after": {strconv.FormatInt(start, 10)}})
	kept := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	require.Equal(t, e1, conn.next(t).Id)
	require.Equal(t, float64(e1), lines.next(t)["id"])
	require.Equal(t, e1, kept.next(t).Id)

	// Half-way: the token is checked again (every second), and still good.
	e2 := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	clk.Advance(30 * time.Second)
	require.Equal(t, e2, conn.next(t).Id)
	require.Equal(t, float64(e2), lines.next(t)["id"])
	require.Equal(t, e2, kept.next(t).Id)

	clk.Set(exp)
	requireCode(t, conn.ended(t), connect.CodeUnauthenticated, "api token expired at")
	lines.requireEnd(t, connect.CodeUnauthenticated, "api token expired at")

	e3 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	clk.Advance(time.Second)
	require.Equal(t, e3, kept.next(t).Id)
}
