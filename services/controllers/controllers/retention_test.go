package controllers_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/syncbuf"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

const day = 24 * time.Hour

// column returns the text of one column of every row of query, sorted by
// the query.
func column(t *testing.T, db *store.DB, query string, args ...any) []string {
	t.Helper()
	rows, err := db.Pool.Query(t.Context(), query, args...)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	if out == nil {
		out = []string{}
	}
	return out
}

// TestRetentionPass runs one pass with the default retentions over rows
// of every kind, each just past or just inside its retention: the rows past
// it are gone, those inside are kept, and what the others need of them is
// kept too (an open command, an acceptance command of a node still
// accepting, an ended reservation whose last usage window is not written, a
// node's newest certificate, a revoked certificate not yet expired, a node
// whose join token went); the bookings and tunnel tickets of a deleted
// reservation go with it, its usage windows stay.
func TestRetentionPass(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	tenant := storetest.Tenant(t, db, nil).ID
	site := storetest.Site(t, db, nil).ID
	pool := storetest.Pool(t, db, &storetest.PoolOpts{SiteID: site, OwnerTenantID: tenant}).ID
	node := func(id, state string, token string) string {
		return storetest.Node(t, db, &storetest.NodeOpts{ID: id, PoolID: pool, State: state, JoinTokenID: token}).ID
	}

	// Join tokens: 7 days after expiry or revocation.
	expired := storetest.JoinToken(t, db, &storetest.JoinTokenOpts{ID: "jt_expired", PoolID: pool, CreatedAt: ago(9 * day),
		ExpiresAt: ago(8 * day)})
	storetest.JoinToken(t, db, &storetest.JoinTokenOpts{ID: "jt_revoked", PoolID: pool, CreatedAt: ago(9 * day),
		ExpiresAt: now.Add(day), RevokedAt: ago(8 * day)})
	storetest.JoinToken(t, db, &storetest.JoinTokenOpts{ID: "jt_recent", PoolID: pool, CreatedAt: ago(9 * day),
		ExpiresAt: ago(6 * day)})
	storetest.JoinToken(t, db, &storetest.JoinTokenOpts{ID: "jt_used_up", PoolID: pool, CreatedAt: ago(9 * day),
		ExpiresAt: now.Add(day), MaxUses: 1, Uses: 1})
	adopted := node("node_adopted", store.NodeAdopted, expired.ID)
	accepting := node("node_accepting", store.NodeAccepting, "")
	lonely := node("node_lonely", store.NodeAdopted, "")

	// Events (30 days) in id order: the one past retention after a kept
	// one is kept too (deletion stops at the first event not due).
	for _, e := range []struct {
		subject string
		at      time.Time
	}{{"ev_old1", ago(31 * day)}, {"ev_old2", ago(31 * day)}, {"ev_new", ago(29 * day)}, {"ev_old3", ago(31 * day)}} {
		storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant, SubjectID: e.subject, CreatedAt: e.at})
	}
	// Audit rows (a year).
	for _, at := range []time.Time{ago(366 * day), ago(364 * day)} {
		_, err := store.InsertAudit(ctx, db.Pool, store.AuditEntry{At: at, TenantID: tenant, Procedure: "/test",
			Target: at.Format(time.DateOnly), Outcome: "ok"})
		require.NoError(t, err)
	}
	// Commands (30 days after they finished), named by CreatedBy: their ids
	// are made at CreatedAt, as the API's are (retention walks the ids by
	// creation time).
	for _, c := range []storetest.CommandOpts{
		{CreatedBy: "cmd_old", NodeID: adopted, State: "succeeded", CreatedAt: ago(40 * day), FinishedAt: ago(31 * day)},
		{CreatedBy: "cmd_recent", NodeID: adopted, State: "failed", CreatedAt: ago(40 * day), FinishedAt: ago(29 * day)},
		{CreatedBy: "cmd_open", NodeID: adopted, State: "queued", CreatedAt: ago(40 * day)},
		{CreatedBy: "cmd_acc_adopted", NodeID: adopted, Purpose: "acceptance", State: "succeeded", CreatedAt: ago(40 * day),
			FinishedAt: ago(31 * day)},
		{CreatedBy: "cmd_acc_accepting", NodeID: accepting, Purpose: "acceptance", State: "expired", CreatedAt: ago(40 * day),
			FinishedAt: ago(31 * day)},
	} {
		storetest.Command(t, db, &c)
	}
	// Reservations (90 days after they ended), with bookings; the last
	// window of res_old is written, that of res_unbilled is not.
	reservation := func(id, state string, end time.Time, devices ...int32) {
		storetest.Reservation(t, db, &storetest.ReservationOpts{ID: id, TenantID: tenant, PoolID: pool, State: state,
			NodeID: adopted, DeviceIndexes: devices, StartAt: end.Add(-time.Hour), EndAt: end, PlacedAt: end.Add(-time.Hour),
			EndedAt: end, CreatedAt: end.Add(-2 * time.Hour)})
	}
	oldEnd := ago(91 * day).Truncate(time.Hour)
	reservation("res_old", store.ReservationExpired, oldEnd, 0)
	reservation("res_unbilled", store.ReservationReleased, oldEnd, 1)
	reservation("res_recent", store.ReservationExpired, ago(89*day).Truncate(time.Hour), 2)
	storetest.Reservation(t, db, &storetest.ReservationOpts{ID: "res_failed", TenantID: tenant, PoolID: pool,
		State: store.ReservationFailed, Reason: "test", CreatedAt: ago(92 * day), EndedAt: ago(91 * day)})
	storetest.UsageWindow(t, db, &storetest.UsageWindowOpts{ReservationID: "res_old", TenantID: tenant, PoolID: pool,
		WindowStart: oldEnd.Add(-time.Hour), GPUSeconds: 3600})
	token := storetest.APIToken(t, db, &storetest.APITokenOpts{TenantID: tenant})
	storetest.TunnelTicket(t, db, &storetest.TunnelTicketOpts{ID: "tkt_old", NodeID: adopted, TokenID: token.ID, Purpose: "ssh",
		ReservationID: "res_old", CreatedAt: oldEnd.Add(-time.Hour)})
	// Usage windows (400 days).
	for _, w := range []struct {
		res string
		at  time.Time
	}{{"res_gone_long_ago", ago(401 * day)}, {"res_gone_a_while_ago", ago(399 * day)}} {
		storetest.UsageWindow(t, db, &storetest.UsageWindowOpts{ReservationID: w.res, TenantID: tenant, PoolID: pool,
			WindowStart: w.at.Truncate(time.Hour), GPUSeconds: 1})
	}
	// Node certificates (30 days after expiry; a node's newest is kept).
	for _, c := range []storetest.NodeCertOpts{
		{Serial: "c0ffee01", NodeID: adopted, NotBefore: ago(32 * day), NotAfter: ago(31 * day)},
		{Serial: "c0ffee02", NodeID: adopted, NotBefore: ago(32 * day), NotAfter: ago(31 * day), RevokedAt: ago(31 * day)},
		{Serial: "c0ffee03", NodeID: adopted, NotBefore: ago(30 * day), NotAfter: ago(29 * day)},
		{Serial: "c0ffee04", NodeID: adopted, NotBefore: ago(40 * day), NotAfter: now.Add(day), RevokedAt: ago(40 * day)},
		{Serial: "c0ffee05", NodeID: adopted, NotBefore: now, NotAfter: now.Add(2 * day)},
		{Serial: "c0ffee06", NodeID: lonely, NotBefore: ago(61 * day), NotAfter: ago(60 * day)},
	} {
		storetest.NodeCert(t, db, &c)
	}

	r := &controllers.Retention{DB: db}
	pass, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, controllers.RetentionPass{Events: 2, Audit: 1, Commands: 2, Reservations: 2, UsageWindows: 1, NodeCerts: 2,
		JoinTokens: 2, Batches: 7}, pass)

	require.Equal(t, []string{"ev_new", "ev_old3"}, column(t, db, `SELECT subject_id FROM events ORDER BY id`))
	require.Equal(t, []string{ago(364 * day).Format(time.DateOnly)}, column(t, db, `SELECT target FROM audit`))
	require.Equal(t, []string{"cmd_acc_accepting", "cmd_open", "cmd_recent"}, column(t, db, `SELECT created_by FROM commands ORDER BY 1`))
	require.Equal(t, []string{"res_recent", "res_unbilled"}, column(t, db, `SELECT id FROM reservations ORDER BY id`))
	require.Equal(t, []string{"res_recent", "res_unbilled"}, column(t, db, `SELECT reservation_id FROM bookings ORDER BY 1`),
		"a reservation's bookings go with it")
	require.Equal(t, []string{}, column(t, db, `SELECT id FROM tunnel_tickets`))
	require.Equal(t, []string{"res_gone_a_while_ago", "res_old"}, column(t, db, `SELECT reservation_id FROM usage_windows ORDER BY 1`),
		"windows outlive their reservation")
	require.Equal(t, []string{"c0ffee03", "c0ffee04", "c0ffee05", "c0ffee06"}, column(t, db, `SELECT serial FROM node_certs ORDER BY 1`))
	require.Equal(t, []string{"jt_recent", "jt_used_up"}, column(t, db, `SELECT id FROM join_tokens ORDER BY 1`))
	n, err := store.GetNode(ctx, db.Pool, store.AllTenants, adopted)
	require.NoError(t, err)
	require.Empty(t, n.JoinTokenID, "the node stays; its token is gone")

	// What the watch reads of it: the tenant's removed ids, and the oldest kept.
	removed, oldest, err := store.EventRetention(ctx, db.Pool, store.TenantScope(tenant))
	require.NoError(t, err)
	ids := column(t, db, `SELECT id::text FROM events ORDER BY id`)
	require.Equal(t, ids[0], strconv.FormatInt(oldest, 10))
	require.Less(t, removed, oldest)

	// A second pass finds nothing.
	pass, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, pass.Total())
}

// TestRetentionBatches: a pass deletes in statements of at most Batch rows
// (here 3 of 10 due events and 4 due commands: 4 + 2 statements), and stops
// when ctx ends during its pause.
func TestRetentionBatches(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	tenant := storetest.Tenant(t, db, nil).ID
	nodeID := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted}).ID
	for range 10 {
		storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant, CreatedAt: now.Add(-31 * day)})
	}
	for range 4 {
		storetest.Command(t, db, &storetest.CommandOpts{NodeID: nodeID, State: "succeeded", CreatedAt: now.Add(-31 * day)})
	}
	for _, limit := range []int{3, 3, 3, 1, 0} {
		n, err := store.DeleteOldEvents(ctx, db.Pool, now.Add(-30*day), 3)
		require.NoError(t, err)
		require.Equal(t, limit, n)
	}
	r := &controllers.Retention{DB: db, Config: controllers.RetentionConfig{RetentionBatch: 3, RetentionPause: time.Millisecond}}
	pass, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, controllers.RetentionPass{Commands: 4, Batches: 2}, pass)

	for range 4 {
		storetest.Command(t, db, &storetest.CommandOpts{NodeID: nodeID, State: "succeeded", CreatedAt: now.Add(-31 * day)})
	}
	stopped, cancel := context.WithCancel(ctx)
	cancel()
	_, err = r.Reconcile(stopped)
	require.ErrorIs(t, err, context.Canceled)
}

// TestRetentionLease runs two controllers replicas on one database with a
// short retention interval while old events keep coming: only the replica
// holding the retention lease deletes them (logs "retention deleted
// rows"), the other never does.
func TestRetentionLease(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	_, nc := startNATS(t)
	tenant := storetest.Tenant(t, db, nil).ID
	ctx, cancel := context.WithCancel(t.Context())
	type replica struct {
		holder string
		logs   *syncbuf.Buffer
		errc   chan error
	}
	var replicas []replica
	for _, holder := range []string{"replica-1", "replica-2"} {
		logs := &syncbuf.Buffer{}
		srv, err := controllers.New(controllers.Config{Probes: service.Probes{NoHealthServer: true},
			Leases:          service.Leases{Holder: holder},
			RetentionConfig: controllers.RetentionConfig{RetentionInterval: 20 * time.Millisecond}},
			controllers.Deps{DB: db, NC: nc, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		require.NoError(t, err)
		r := replica{holder: holder, logs: logs, errc: make(chan error, 1)}
		go func() { r.errc <- srv.Run(ctx) }()
		replicas = append(replicas, r)
	}
	_, err := controllers.New(controllers.Config{Probes: service.Probes{NoHealthServer: true},
		RetentionConfig: controllers.RetentionConfig{RetentionEvents: 30 * time.Minute}}, controllers.Deps{DB: db, NC: nc})
	require.ErrorContains(t, err, "BETTER_COMPUTE_RETENTION_EVENTS: 30m0s is below 1h0m0s", "New refuses it")
	deletedBy := func(r replica) int { return strings.Count(r.logs.String(), "retention deleted rows") }
	for range 20 {
		storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant, CreatedAt: db.Now().Add(-31 * day)})
		require.Eventually(t, func() bool {
			var n int
			require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM events`).Scan(&n))
			return n == 0
		}, 10*time.Second, 10*time.Millisecond, "the holder deletes the old event")
	}
	lease, err := store.GetLease(ctx, db.Pool, controllers.LeaseRetention)
	require.NoError(t, err)
	cancel()
	for _, r := range replicas {
		require.NoError(t, <-r.errc)
	}
	got := map[string]int{}
	for _, r := range replicas {
		got[r.holder] = deletedBy(r)
	}
	want := map[string]int{"replica-1": 0, "replica-2": 0}
	want[lease.Holder] = 20
	require.Empty(t, cmp.Diff(want, got), "deletions per replica")
}

// TestRetentionConfig: the defaults are the documented ones, usage windows
// outlive events and reservations; a retention that is not positive,
// unparsable, or below the horizon it would break refuses to start with
// one line naming the variable.
func TestRetentionConfig(t *testing.T) {
	t.Parallel()
	var cfg controllers.RetentionConfig
	config.SetDefaults(&cfg)
	require.Equal(t, controllers.RetentionConfig{RetentionEvents: controllers.DefaultRetentionEvents,
		RetentionAudit: controllers.DefaultRetentionAudit, RetentionCommands: controllers.DefaultRetentionCommands,
		RetentionReservations: controllers.DefaultRetentionReservations, RetentionUsage: controllers.DefaultRetentionUsage,
		RetentionCerts: controllers.DefaultRetentionCerts, RetentionJoinTokens: controllers.DefaultRetentionJoinTokens,
		RetentionInterval: controllers.DefaultRetentionInterval, RetentionBatch: controllers.DefaultRetentionBatch,
		RetentionPause: controllers.DefaultRetentionPause}, cfg)
	require.Greater(t, cfg.RetentionUsage, cfg.RetentionEvents)
	require.GreaterOrEqual(t, cfg.RetentionUsage, cfg.RetentionReservations)
	require.NoError(t, cfg.Check(controllers.DefaultJoiningTimeout))

	for _, tc := range []struct {
		name, env, value, want string
	}{
		{"negative", "RETENTION_EVENTS", "-1h", `BETTER_COMPUTE_RETENTION_EVENTS: must be positive, got "-1h"`},
		{"zero", "RETENTION_AUDIT", "0", `BETTER_COMPUTE_RETENTION_AUDIT: must be positive, got "0"`},
		{"unparsable", "RETENTION_USAGE", "400 days", `BETTER_COMPUTE_RETENTION_USAGE: `},
		{"negative batch", "RETENTION_BATCH", "-5", `BETTER_COMPUTE_RETENTION_BATCH: must be positive, got "-5"`},
		{"negative pause", "RETENTION_PAUSE", "-1s", "BETTER_COMPUTE_RETENTION_PAUSE: must not be negative, got -1s"},
		{"events below the watch's horizon", "RETENTION_EVENTS", "30m",
			"BETTER_COMPUTE_RETENTION_EVENTS: 30m0s is below 1h0m0s, the events watch's horizon (MaxGrace, reconnects)"},
		{"commands below the command timeout", "RETENTION_COMMANDS", "12h",
			"BETTER_COMPUTE_RETENTION_COMMANDS: 12h0m0s is below 24h0m0s, the longest command timeout"},
		{"reservations below a day", "RETENTION_RESERVATIONS", "1h",
			"BETTER_COMPUTE_RETENTION_RESERVATIONS: 1h0m0s is below 24h0m0s"},
		{"usage below reservations", "RETENTION_USAGE", "48h",
			"BETTER_COMPUTE_RETENTION_USAGE: 48h0m0s is below 2160h0m0s, RETENTION_RESERVATIONS"},
		{"certificates below the session horizon", "RETENTION_CERTS", "10m",
			"BETTER_COMPUTE_RETENTION_CERTS: 10m0s is below 1h0m0s"},
		{"join tokens below the joining timeout", "RETENTION_JOIN_TOKENS", "30m",
			"BETTER_COMPUTE_RETENTION_JOIN_TOKENS: 30m0s is below 1h0m0s, JOINING_TIMEOUT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var cfg controllers.Config
			err := config.Load(&cfg, func(k string) string {
				if k == config.Prefix+tc.env {
					return tc.value
				}
				return ""
			})
			if err == nil {
				err = cfg.Check(cfg.JoiningTimeout) // what New checks first
			}
			require.Error(t, err)
			var cerr *config.Error
			require.True(t, errors.As(err, &cerr), "%v", err)
			require.Equal(t, config.Prefix+tc.env, cerr.Name)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "\n", "one line")
		})
	}
}
