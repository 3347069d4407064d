package api_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/services/api/api"
)

// TestWatchRevealsNoOtherTenant checks, with two tenants, that a tenant's
// watch says nothing of the other's events: the cursor of a watch from now
// (Bc-Watch-After, on both paths) is the newest id of the caller's own
// events, a resume after an id above that is refused naming that id (not
// the newest of all), and a root administrator's cursor is the newest of
// all.
func TestWatchRevealsNoOtherTenant(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	viewer := f.tokens["acme-viewer"]
	own := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.cordoned")
	foreign := insertEvent(t, f.db, nil, f.db.Now(), f.other, "node.cordoned")
	require.Greater(t, foreign, own)
	ownText, foreignText := strconv.FormatInt(own, 10), strconv.FormatInt(foreign, 10)

	res := f.getWatch(ctx, t, viewer, nil)
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, ownText, res.Header.Get(api.WatchCursorHeader), "the newest of acme's events, not of all")
	stream, err := f.as(viewer).events.Watch(ctx, connect.NewRequest(&computev1.WatchRequest{}))
	require.NoError(t, err)
	defer stream.Close()
	require.Equal(t, ownText, stream.ResponseHeader().Get(api.WatchCursorHeader))

	refusal := watch(t, f.as(viewer), &computev1.WatchRequest{AfterId: foreign}).refusal(t)
	requireCode(t, refusal, connect.CodeInvalidArgument, "after_id: "+foreignText+" is above the newest event id, "+ownText)
	require.NotContains(t, refusal.Error(), "id, "+foreignText)
	f.refusedWatch(t, viewer, url.Values{"after": {foreignText}}, http.StatusBadRequest, "invalid_argument",
		"after: "+foreignText+" is above the newest event id, "+ownText)

	root := f.getWatch(ctx, t, f.tokens["root"], nil)
	defer root.Body.Close()
	require.Equal(t, foreignText, root.Header.Get(api.WatchCursorHeader), "root sees every tenant")
}

// TestWatchLimitPerToken checks that a token holds at most 16 watches
// open (WatchConfig.LimitPerToken's default), Connect and NDJSON together:
// the next is ResourceExhausted (429), another token is not affected, and
// ending one frees its slot.
func TestWatchLimitPerToken(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	viewer := f.tokens["acme-viewer"]
	c := f.as(viewer)
	open := func() (*connect.ServerStreamForClient[computev1.WatchResponse], context.CancelFunc) {
		t.Helper()
		sctx, cancel := context.WithCancel(ctx)
		stream, err := c.events.Watch(sctx, connect.NewRequest(&computev1.WatchRequest{}))
		require.NoError(t, err)
		t.Cleanup(func() { cancel(); _ = stream.Close() })
		stream.ResponseHeader() // the watch has begun: its slot is taken
		return stream, cancel
	}
	var cancels []context.CancelFunc
	for range 15 {
		_, cancel := open()
		cancels = append(cancels, cancel)
	}
	res := f.getWatch(ctx, t, viewer, nil) // the 16th
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)

	refusal := watch(t, c, &computev1.WatchRequest{}).refusal(t)
	requireCode(t, refusal, connect.CodeResourceExhausted, "this API token has 16 events watches open on this server")
	f.refusedWatch(t, viewer, nil, http.StatusTooManyRequests, "resource_exhausted", "16 events watches open")
	other := f.getWatch(ctx, t, f.tokens["acme-member"], nil)
	defer other.Body.Close()
	require.Equal(t, http.StatusOK, other.StatusCode, "another token has slots of its own")

	cancels[0]()
	require.Eventually(t, func() bool {
		sctx, cancel := context.WithCancel(ctx)
		defer cancel()
		stream, err := c.events.Watch(sctx, connect.NewRequest(&computev1.WatchRequest{}))
		if err != nil {
			return false
		}
		defer stream.Close()
		stream.ResponseHeader()
		return stream.Err() == nil && stream.ResponseHeader().Get(api.WatchCursorHeader) != ""
	}, 10*time.Second, 20*time.Millisecond, "an ended watch frees its slot")
}
