package cli_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// reservationOut is the part of a printed reservation the tests read.
type reservationOut struct {
	ID      string   `json:"id"`
	PoolID  string   `json:"poolId"`
	Gpus    int      `json:"gpus"`
	State   string   `json:"state"`
	Reason  string   `json:"reason"`
	Binding []string `json:"binding"`
}

// reserveOne reserves one GPU of f's pool for an hour as r and returns the
// reservation's id.
func (f *fleet) reserveOne(t *testing.T, r runner) string {
	t.Helper()
	res := r.run(t, "reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h")
	require.Equal(t, 0, res.code, res.stderr)
	return parseReservation(t, res.stdout).ID
}

func parseReservation(t *testing.T, out string) reservationOut {
	t.Helper()
	var r reservationOut
	require.NoError(t, json.Unmarshal([]byte(out), &r), out)
	return r
}

// TestReserveWalkthrough is the README's walkthrough (offer, reserve), then
// list, get, release and usage.
func TestReserveWalkthrough(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := runner{env: map[string]string{"BETTER_COMPUTE_URL": f.url, "BETTER_COMPUTE_TOKEN": f.root,
		"BETTER_COMPUTE_TENANT": f.tenant}}

	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=64")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "pool "+f.poolID+" offered to "+f.tenant+": quota gpu=64 (0 in use)\n", res.stdout)

	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "4", "--for", "1h")
	require.Equal(t, 0, res.code, res.stderr)
	first := parseReservation(t, res.stdout)
	require.Equal(t, "pending", first.State)
	require.Equal(t, 4, first.Gpus)
	require.Equal(t, f.poolID, first.PoolID)

	res = r.run(t, "pools", "offers")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, []string{"POOL", "TENANT", "GPU", "QUOTA", "GPUS", "IN", "USE", f.poolID, f.tenant, "64", "4"},
		strings.Fields(res.stdout))

	// Idempotent by request id.
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "2", "--for", "30m", "--request-id", "job-7",
		"--start", clock.New().Now().Add(time.Hour).UTC().Format(time.RFC3339))
	require.Equal(t, 0, res.code, res.stderr)
	second := parseReservation(t, res.stdout)
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "2", "--for", "30m", "--request-id", "job-7")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, second.ID, parseReservation(t, res.stdout).ID)

	res = r.run(t, "reservations", "list")
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Len(t, lines, 3, res.stdout)
	require.Equal(t, []string{"ID", "POOL", "GPUS", "STATE", "NODE", "START", "END", "REASON"}, strings.Fields(lines[0]))
	require.Equal(t, []string{first.ID, f.poolID, "4", "pending", "-"}, strings.Fields(lines[1])[:5])

	res = r.run(t, "release", first.ID)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "released", parseReservation(t, res.stdout).State)
	res = r.run(t, "reservations", "get", first.ID)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "released", parseReservation(t, res.stdout).State)
	res = r.run(t, "reservations", "list", "--state", "pending", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var pending []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &pending))
	require.Len(t, pending, 1)
	require.Equal(t, second.ID, pending[0]["id"])

	// Usage: the windows the controllers wrote, with a total.
	hour := time.Date(2025, 3, 1, 10, 0, 0, 0, time.UTC)
	for i, secs := range []int64{1800 * 4, 3600 * 4} {
		start := hour.Add(time.Duration(i) * time.Hour)
		storetest.UsageWindow(t, f.db, &storetest.UsageWindowOpts{ReservationID: first.ID, TenantID: f.tenant, PoolID: f.poolID,
			WindowStart: start, GPUSeconds: secs, CreatedAt: start})
	}
	res = r.run(t, "usage")
	require.Equal(t, 0, res.code, res.stderr)
	lines = strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Len(t, lines, 4, res.stdout)
	require.Equal(t, []string{"2025-03-01T10:00:00Z", first.ID, f.poolID, "7200", "2.00"}, strings.Fields(lines[1]))
	require.Equal(t, []string{"TOTAL", "21600", "6.00"}, strings.Fields(lines[3]))
	res = r.run(t, "usage", "--since", "2025-03-01T11:30:00Z", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var usage struct {
		Windows []map[string]any `json:"windows"`
		Total   int64            `json:"totalGpuSeconds"`
	}
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &usage), res.stdout)
	require.Len(t, usage.Windows, 1)
	require.EqualValues(t, 14400, usage.Total)
}

func TestReserveWait(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := runner{env: map[string]string{"BETTER_COMPUTE_URL": f.url, "BETTER_COMPUTE_TOKEN": f.root}, clk: clock.New()}
	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)

	// Nothing places it: --wait gives up after --timeout.
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h", "--wait", "--timeout", "600ms")
	require.Equal(t, 1, res.code)
	pending := parseReservation(t, res.stdout)
	require.Equal(t, "error: reservation "+pending.ID+" is still pending after 600ms; it is still queued (pending) and holds 1 GPUs of pool "+
		f.poolID+"'s quota: cancel it with `better-compute release "+pending.ID+"`\n", res.stderr)

	// Active as soon as the node bound it (here: by the store functions
	// the scheduler and the gateway call).
	go func() {
		for range 100 {
			if done, err := activate(t.Context(), f.db, f.adopted, "w"); err != nil || done {
				return
			}
			_ = clock.Sleep(t.Context(), clock.New(), 50*time.Millisecond)
		}
	}()
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h", "--request-id", "w", "--wait", "--timeout", "10s")
	require.Equal(t, 0, res.code, res.stderr)
	active := parseReservation(t, res.stdout)
	require.Equal(t, "active", active.State)
	require.Equal(t, []string{"nvidia.com/gpu=0"}, active.Binding)

	// No node of the pool has 9 GPUs: failed at once, exit 1 with the reason.
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "9", "--for", "1h", "--wait")
	require.Equal(t, 1, res.code)
	failed := parseReservation(t, res.stdout)
	require.Equal(t, "failed", failed.State)
	require.Equal(t, "error: reservation "+failed.ID+" is failed: no node of pool "+f.poolID+" has 9 GPUs (largest: 8)\n", res.stderr)
}

// TestReserveWaitRidesOutAnOutage: `reserve --wait` keeps polling through
// an API that cannot answer for a while (the reservation goes on without it)
// and reports it active.
func TestReserveWaitRidesOutAnOutage(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	var refused atomic.Int64
	r := f.proxied(t, func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/GetReservation") || refused.Add(1) > 3 {
			return false
		}
		unavailable(w)
		return true
	})
	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)
	go func() {
		for refused.Load() <= 3 {
			if clock.Sleep(t.Context(), clock.New(), 20*time.Millisecond) != nil {
				return
			}
		}
		for range 100 {
			if done, err := activate(t.Context(), f.db, f.adopted, "o"); err != nil || done {
				return
			}
			_ = clock.Sleep(t.Context(), clock.New(), 50*time.Millisecond)
		}
	}()
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h", "--request-id", "o", "--wait", "--timeout", "30s")
	require.Equal(t, 0, res.code, res.stderr)
	active := parseReservation(t, res.stdout)
	require.Equal(t, "active", active.State)
	require.Contains(t, res.stderr, "reserve: waiting for "+active.ID+": unavailable: the api is restarting; retrying in 500ms\n")
	require.Contains(t, res.stderr, "retrying in 1s\n", "the delay doubles")
}

// TestReserveWaitFailsNamingTheReservation: when `reserve --wait` stops
// waiting, through an outage that outlasts --timeout or an error that is
// not transient, it prints the reservation and says that it is still queued,
// holds quota, and how to cancel it.
func TestReserveWaitFailsNamingTheReservation(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	var down, refuse atomic.Bool
	r := f.proxied(t, func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/GetReservation") {
			return false
		}
		switch {
		case down.Load():
			unavailable(w)
		case refuse.Load():
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusForbidden)
			_, _ = w.Write([]byte(`{"code":"permission_denied","message":"token revoked"}`))
		default:
			return false
		}
		return true
	})
	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)
	held := func(id string) string {
		return "it is still queued (pending) and holds 2 GPUs of pool " + f.poolID + "'s quota: cancel it with `better-compute release " + id + "`\n"
	}

	down.Store(true)
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "2", "--for", "1h", "--wait", "--timeout", "1500ms")
	require.Equal(t, 1, res.code)
	out := parseReservation(t, res.stdout)
	require.Equal(t, "pending", out.State)
	require.Contains(t, res.stderr, "reserve: waiting for "+out.ID+": unavailable: the api is restarting; retrying in ")
	require.True(t, strings.HasSuffix(res.stderr, "error: reservation "+out.ID+" is still pending after 1.5s; "+held(out.ID)), res.stderr)

	down.Store(false)
	refuse.Store(true)
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "2", "--for", "1h", "--wait", "--timeout", "30s")
	require.Equal(t, 1, res.code)
	out = parseReservation(t, res.stdout)
	require.Equal(t, "pending", out.State)
	require.Equal(t, "error: permission_denied: waiting for reservation "+out.ID+": token revoked; "+held(out.ID), res.stderr)
}

// proxied returns a runner as root through a proxy of the fleet's API that
// answers a request with intercept when it returns true.
func (f *fleet) proxied(t *testing.T, intercept func(http.ResponseWriter, *http.Request) bool) runner {
	t.Helper()
	target, err := url.Parse(f.url)
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !intercept(w, r) {
			proxy.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return runner{env: map[string]string{"BETTER_COMPUTE_URL": srv.URL, "BETTER_COMPUTE_TOKEN": f.root}, clk: clock.New()}
}

// unavailable answers a Connect unary call with Unavailable.
func unavailable(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = w.Write([]byte(`{"code":"unavailable","message":"the api is restarting"}`))
}

func TestReserveErrors(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	res := root.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=4")
	require.Equal(t, 0, res.code, res.stderr)
	res = root.run(t, "reserve", "--pool", f.poolID, "--gpus", "4", "--for", "1h")
	require.Equal(t, 0, res.code, res.stderr)

	for _, tc := range []struct {
		name   string
		r      runner
		args   []string
		stderr string
	}{
		{"quota", root, []string{"reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h"},
			"error: resource_exhausted: --gpus: quota of pool " + f.poolID + " is 4 GPUs, 4 in use, 1 requested\n"},
		{"zero gpus", root, []string{"reserve", "--pool", f.poolID, "--gpus", "0", "--for", "1h"},
			"error: invalid_argument: --gpus: "},
		{"negative duration", root, []string{"reserve", "--pool", f.poolID, "--gpus", "1", "--for", "-1h"},
			"error: invalid_argument: --for: "},
		{"bad start", root, []string{"reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h", "--start", "tomorrow"},
			"error: --start: want an RFC 3339 time"},
		{"bad quota", root, []string{"pools", "offer", f.poolID, "--to", f.tenant, "--quota", "cpu=4"},
			"error: --quota: want gpu=N (e.g. gpu=64), got \"cpu=4\"\n"},
		{"missing flags", root, []string{"reserve", "--pool", f.poolID}, "error: required flag(s) \"for\", \"gpus\" not set\n"},
		{"viewer reserves", f.runner(f.viewer), []string{"reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h"},
			"error: permission_denied: role viewer may not call Reserve (needs reservations.write)\n"},
		{"release missing", root, []string{"release", "res_missing"}, "error: not_found: reservation res_missing not found\n"},
		{"bad state", root, []string{"reservations", "list", "--state", "running"}, "error: invalid_argument: --state: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := tc.r.run(t, tc.args...)
			require.Equal(t, 1, res.code, res.stdout)
			require.True(t, strings.HasPrefix(res.stderr, tc.stderr), "stderr %q, want prefix %q", res.stderr, tc.stderr)
		})
	}
}

// activate places the pending reservation of request id requestID on device
// 0 of node and activates it, as the scheduler and the gateway would, and
// reports whether there was one.
func activate(ctx context.Context, db *store.DB, node, requestID string) (bool, error) {
	pending, err := store.ListReservations(ctx, db.Pool, store.ReservationFilter{Scope: store.AllTenants, State: store.ReservationPending})
	if err != nil {
		return false, err
	}
	i := slices.IndexFunc(pending, func(r store.Reservation) bool { return r.RequestID == requestID })
	if i < 0 {
		return false, nil
	}
	r := pending[i]
	return true, db.InTx(ctx, func(tx pgx.Tx) error {
		now := db.Now()
		if _, err := store.PlaceReservations(ctx, tx, nil, now, []store.Placement{{ReservationID: r.ID, TenantID: r.TenantID,
			NodeID: node, Devices: []int32{0}, Lower: now, Upper: r.EndAt}}); err != nil {
			return err
		}
		placed, err := store.GetReservation(ctx, tx, store.AllTenants, r.ID)
		if err != nil {
			return err
		}
		_, err = store.ActivateReservation(ctx, tx, now, node, r.ID, []string{"nvidia.com/gpu=0"}, *placed.SpecGeneration)
		return err
	})
}

// TestReleaseEnded: releasing a reservation that had already ended
// (released, or failed) says so on standard error, with its state, when it
// ended and why, prints nothing on standard output and exits 0; the API
// still decides who may release (a viewer is refused).
func TestReleaseEnded(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)
	id := f.reserveOne(t, r)
	res = r.run(t, "release", id)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "released", parseReservation(t, res.stdout).State)
	require.Empty(t, res.stderr)
	var ended struct {
		EndedAt time.Time `json:"endedAt"`
	}
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &ended))
	require.False(t, ended.EndedAt.IsZero())

	res = r.run(t, "release", id)
	require.Equal(t, 0, res.code, res.stderr)
	require.Empty(t, res.stdout)
	require.Equal(t, "reservation "+id+" had already ended: released at "+ended.EndedAt.UTC().Format(time.RFC3339)+
		"; nothing to release\n", res.stderr)

	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "9", "--for", "1h")
	require.Equal(t, 1, res.code)
	failed := parseReservation(t, res.stdout).ID
	res = r.run(t, "release", failed)
	require.Equal(t, 0, res.code, res.stderr)
	require.Empty(t, res.stdout)
	require.Regexp(t, `^reservation `+failed+` had already ended: failed at \S+Z: no node of pool `+f.poolID+
		` has 9 GPUs \(largest: 8\); nothing to release\n$`, res.stderr)

	res = f.runner(f.viewer).run(t, "release", id)
	require.Equal(t, 1, res.code)
	require.Empty(t, res.stdout)
	require.Equal(t, "error: permission_denied: role viewer may not call ReleaseReservation (needs reservations.write)\n", res.stderr)
}
