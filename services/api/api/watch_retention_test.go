package api_test

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
)

// TestWatchRefusesWhatRetentionRemoved: after retention removed old events
// of two tenants, a resume below what it removed of the caller's own
// events is refused (FailedPrecondition; HTTP 410) naming the oldest id kept
// of the caller's scope, never another tenant's; a resume at what it
// removed, and a watch from the start, go on; what retention removed of
// one tenant does not refuse the other's resume; a root administrator's
// scope is every tenant's.
func TestWatchRefusesWhatRetentionRemoved(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	old := now.Add(-2 * time.Hour)
	a1 := insertEvent(t, f.db, nil, old, f.acme, "node.cordoned")
	o1 := insertEvent(t, f.db, nil, old, f.other, "node.cordoned")
	a2 := insertEvent(t, f.db, nil, old, f.acme, "node.cordoned")
	o2 := insertEvent(t, f.db, nil, now, f.other, "node.cordoned")
	a3 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	n, err := store.DeleteOldEvents(ctx, f.db.Pool, now.Add(-time.Hour), 100)
	require.NoError(t, err)
	require.Equal(t, 3, n, "a1, o1, a2")

	viewer := f.tokens["acme-viewer"]
	refusal := watch(t, f.as(viewer), &computev1.WatchRequest{AfterId: a1}).refusal(t)
	want := fmt.Sprintf("after_id: events after %d were removed by retention (the oldest event id kept is %d): "+
		"watch again from the start (from_start)", a1, a3)
	requireCode(t, refusal, connect.CodeFailedPrecondition, want)
	var cerr *connect.Error
	require.ErrorAs(t, refusal, &cerr)
	require.Equal(t, want, cerr.Message(), "acme's ids only: not o2, the oldest kept of all")
	f.refusedWatch(t, viewer, url.Values{"after": {strconv.FormatInt(a1, 10)}}, http.StatusGone, "failed_precondition",
		fmt.Sprintf("after: events after %d were removed by retention (the oldest event id kept is %d)", a1, a3))

	// At what retention removed, nothing after it is lost.
	require.Equal(t, a3, watch(t, f.as(viewer), &computev1.WatchRequest{AfterId: a2}).next(t).Id)
	require.Equal(t, a3, watch(t, f.as(viewer), &computev1.WatchRequest{FromStart: true}).next(t).Id)
	// The other tenant lost nothing after o1, although acme's a2 is gone.
	otherViewer := f.tokens["other-viewer"]
	require.Equal(t, o2, watch(t, f.as(otherViewer), &computev1.WatchRequest{AfterId: o1}).next(t).Id)
	// A resume after the removed newest id is not "above the newest".
	require.Equal(t, a3, watch(t, f.as(viewer), &computev1.WatchRequest{AfterId: a2}).next(t).Id)

	root := f.tokens["root"]
	refusal = watch(t, f.as(root), &computev1.WatchRequest{AfterId: o1}).refusal(t)
	requireCode(t, refusal, connect.CodeFailedPrecondition,
		fmt.Sprintf("after_id: events after %d were removed by retention (the oldest event id kept is %d)", o1, o2))
}

// TestWatchEndsWhenRetentionOvertakesIt: a watch that is behind (here, its
// events held for a transaction still running) when retention removes
// events after its cursor ends with FailedPrecondition instead of skipping
// them.
func TestWatchEndsWhenRetentionOvertakesIt(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	old := now.Add(-2 * time.Hour)
	start := insertEvent(t, f.db, nil, old, f.acme, "node.cordoned")
	tx, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	held := insertEvent(t, f.db, tx, now, f.acme, "node.cordoned") // its id is taken, not committed
	behind := insertEvent(t, f.db, nil, old, f.acme, "node.cordoned")
	require.Greater(t, behind, held)

	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	w.none(t, 300*time.Millisecond) // behind is held for held's transaction
	n, err := store.DeleteOldEvents(ctx, f.db.Pool, now.Add(-time.Hour), 100)
	require.NoError(t, err)
	require.Equal(t, 2, n, "start and behind; held is not committed")
	require.NoError(t, tx.Commit(ctx))
	requireCode(t, w.refusal(t), connect.CodeFailedPrecondition,
		fmt.Sprintf("after_id: events after %d were removed by retention (the oldest event id kept is %d)", start, held))
}
