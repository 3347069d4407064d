package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// gatewayFixture is a database with a pool to put nodes in.
type gatewayFixture struct {
	t      *testing.T
	db     *store.DB
	poolID string
}

func newGatewayFixture(t *testing.T) gatewayFixture {
	t.Helper()
	db := storetest.New(t, clock.New())
	owner := storetest.Tenant(t, db, &storetest.TenantOpts{Name: "gw-acme"})
	site := storetest.Site(t, db, &storetest.SiteOpts{Name: "gw-site"})
	pool := storetest.Pool(t, db, &storetest.PoolOpts{SiteID: site.ID, OwnerTenantID: owner.ID, Name: "p"})
	return gatewayFixture{t: t, db: db, poolID: pool.ID}
}

// node inserts an accepting node of the pool and returns its id.
func (f gatewayFixture) node() string {
	f.t.Helper()
	return f.nodeWith(storetest.NodeOpts{})
}

// nodeWith inserts an accepting node of the pool with opts and returns its
// id.
func (f gatewayFixture) nodeWith(opts storetest.NodeOpts) string {
	f.t.Helper()
	opts.PoolID, opts.State = f.poolID, store.NodeAccepting
	return storetest.Node(f.t, f.db, &opts).ID
}

// command inserts a diag.nvml command of nodeID created at createdAt, due an
// hour later, and returns its id.
func (f gatewayFixture) command(nodeID, state, purpose string, createdAt time.Time) string {
	f.t.Helper()
	return storetest.Command(f.t, f.db, &storetest.CommandOpts{ID: ids.New(ids.Command, createdAt), NodeID: nodeID, State: state,
		Purpose: purpose, RetrySafe: new(bool), CreatedAt: createdAt}).ID
}

func (f gatewayFixture) open(nodeID, gw string, observed int64) (string, store.OpenedSession) {
	f.t.Helper()
	sid := ids.New(ids.Session, f.db.Now())
	o, err := storetest.OpenSession(f.t, f.db.Pool, store.OpenSessionParams{
		NodeID: nodeID, GatewayID: gw, SessionID: sid, BootID: "boot", AgentVersion: "v1",
		ObservedGeneration: observed, Now: f.db.Now(),
	})
	require.NoError(f.t, err)
	return sid, o
}

func (f gatewayFixture) session(nodeID string) (gw, sid *string, reachable bool, lastSeen *time.Time, observed int64) {
	f.t.Helper()
	require.NoError(f.t, f.db.Pool.QueryRow(context.Background(), `SELECT gateway_id, session_id, reachable, last_seen,
		observed_generation FROM nodes WHERE id = $1`, nodeID).Scan(&gw, &sid, &reachable, &lastSeen, &observed))
	return
}

func TestSessionOpenCloseAndTakeover(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n := f.nodeWith(storetest.NodeOpts{SpecGeneration: 3, ObservedGeneration: 2})

	s1, o1 := f.open(n, "gw-a", 1)
	require.EqualValues(t, 1, o1.Epoch)
	require.EqualValues(t, 3, o1.SpecGeneration)
	gw, sid, reachable, lastSeen, observed := f.session(n)
	require.Equal(t, "gw-a", *gw)
	require.Equal(t, s1, *sid)
	require.True(t, reachable)
	require.NotNil(t, lastSeen)
	require.EqualValues(t, 2, observed, "a lower hello generation never lowers observed_generation")

	s2, o2 := f.open(n, "gw-b", 3)
	require.EqualValues(t, 2, o2.Epoch)
	_, _, _, _, observed = f.session(n)
	require.EqualValues(t, 3, observed)

	// The superseded session's end leaves the new one but still raises
	// last_seen.
	later := f.db.Now().Add(time.Minute)
	cleared, err := store.CloseSession(ctx, f.db.Pool, f.db.Now(), n, s1, later)
	require.NoError(t, err)
	require.False(t, cleared)
	gw, sid, _, lastSeen, _ = f.session(n)
	require.Equal(t, "gw-b", *gw)
	require.Equal(t, s2, *sid)
	require.True(t, lastSeen.Equal(later))

	cleared, err = store.CloseSession(ctx, f.db.Pool, f.db.Now(), n, s2, time.Time{})
	require.NoError(t, err)
	require.True(t, cleared)
	gw, sid, reachable, _, _ = f.session(n)
	require.Nil(t, gw)
	require.Nil(t, sid)
	require.True(t, reachable, "reachability is the liveness sweeper's")

	res, err := store.OpenSessions(ctx, f.db.Pool, []store.OpenSessionRequest{{Serial: "00",
		OpenSessionParams: store.OpenSessionParams{NodeID: "node_missing", GatewayID: "g", SessionID: "s", Now: f.db.Now()}}})
	require.NoError(t, err)
	require.False(t, res[0].Opened, "no session of a node that does not exist")
}

// openReq is an OpenSessionRequest of nodeID with the certificate serial
// on gateway gw, at now.
func (f gatewayFixture) openReq(nodeID, serial, gw string, now time.Time) store.OpenSessionRequest {
	return store.OpenSessionRequest{Serial: serial, OpenSessionParams: store.OpenSessionParams{NodeID: nodeID, GatewayID: gw,
		SessionID: ids.New(ids.Session, now), BootID: "boot", AgentVersion: "v2", ObservedGeneration: 1, Now: now}}
}

// openReqs inserts n accepting nodes, each with a certificate valid for an
// hour from now, and returns their OpenSessionRequests on gateway gw at now.
func (f gatewayFixture) openReqs(n int, gw string, now time.Time) []store.OpenSessionRequest {
	f.t.Helper()
	reqs := make([]store.OpenSessionRequest, n)
	for i := range reqs {
		node := f.node()
		c := storetest.NodeCert(f.t, f.db, &storetest.NodeCertOpts{NodeID: node, NotAfter: now.Add(time.Hour)})
		reqs[i] = f.openReq(node, c.Serial, gw, now)
	}
	return reqs
}

// reachableEvents returns the node.reachable events of nodeID's, data as
// text, in id order.
func (f gatewayFixture) reachableEvents(nodeID string) []string {
	f.t.Helper()
	rows, err := f.db.Pool.Query(f.t.Context(), `SELECT data::text FROM events WHERE type = 'node.reachable' AND subject_id = $1
		ORDER BY id`, nodeID)
	require.NoError(f.t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.t, err)
	return out
}

// TestOpenSessions: one call opens the sessions whose certificate may open
// them (epoch, spec generation, node.reachable), and
// refuses the others, each with its certificate's row: unknown, another
// node's, revoked, its node revoked, expired. Two requests of one node open
// in order, the second superseding the first.
func TestOpenSessions(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	seen := now.Add(-time.Hour).Truncate(time.Microsecond)
	ok := f.nodeWith(storetest.NodeOpts{SpecGeneration: 4, LastSeen: seen})
	twice := f.node()
	other, revoked, nodeRevoked, expired := f.node(), f.node(), f.nodeWith(storetest.NodeOpts{RevokedAt: now}), f.node()
	cert := func(node string, o storetest.NodeCertOpts) string {
		o.NodeID = node
		if o.NotAfter.IsZero() {
			o.NotAfter = now.Add(time.Hour)
		}
		return storetest.NodeCert(t, f.db, &o).Serial
	}
	okSerial, twiceSerial := cert(ok, storetest.NodeCertOpts{}), cert(twice, storetest.NodeCertOpts{})
	otherSerial := cert(ok, storetest.NodeCertOpts{})
	revokedSerial := cert(revoked, storetest.NodeCertOpts{RevokedAt: now.Add(-time.Minute)})
	nodeRevokedSerial := cert(nodeRevoked, storetest.NodeCertOpts{})
	expiredSerial := cert(expired, storetest.NodeCertOpts{NotBefore: now.Add(-2 * time.Hour), NotAfter: now})

	reqs := []store.OpenSessionRequest{
		f.openReq(ok, okSerial, "gw-a", now),
		f.openReq(twice, twiceSerial, "gw-a", now),
		f.openReq(other, otherSerial, "gw-a", now),
		f.openReq(revoked, revokedSerial, "gw-a", now),
		f.openReq(nodeRevoked, nodeRevokedSerial, "gw-a", now),
		f.openReq(expired, expiredSerial, "gw-a", now),
		f.openReq(other, "ffff", "gw-a", now),
		f.openReq(twice, twiceSerial, "gw-b", now),
	}
	var res []store.OpenSessionResult
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		res, err = store.OpenSessions(ctx, tx, reqs)
		return err
	}))
	require.Len(t, res, len(reqs))

	require.True(t, res[0].Opened)
	require.Equal(t, store.OpenedSession{Epoch: 1, SpecGeneration: 4}, res[0].Session)
	require.True(t, res[0].CertFound)
	require.Equal(t, ok, res[0].Cert.NodeID)
	require.Nil(t, res[0].Cert.RevokedAt)
	gw, sid, reachable, lastSeen, observed := f.session(ok)
	require.Equal(t, "gw-a", *gw)
	require.Equal(t, reqs[0].SessionID, *sid)
	require.True(t, reachable)
	require.True(t, lastSeen.Equal(now.Truncate(time.Microsecond)))
	require.EqualValues(t, 1, observed)
	require.Equal(t, []string{fmt.Sprintf(`{"nodeId": %q, "gatewayId": "gw-a", "sessionId": %q, "previousLastSeen": %q}`,
		ok, reqs[0].SessionID, seen.UTC().Format(time.RFC3339Nano))}, f.reachableEvents(ok))

	require.True(t, res[1].Opened)
	require.EqualValues(t, 1, res[1].Session.Epoch)
	require.True(t, res[7].Opened)
	require.EqualValues(t, 2, res[7].Session.Epoch, "the second request of a node supersedes the first")
	gw, sid, _, _, _ = f.session(twice)
	require.Equal(t, "gw-b", *gw)
	require.Equal(t, reqs[7].SessionID, *sid)
	require.Len(t, f.reachableEvents(twice), 1, "reachable once: the second session found it reachable")

	for _, tc := range []struct {
		name    string
		i       int
		found   bool
		node    string
		revoked bool
	}{
		{name: "another node's certificate", i: 2, found: true, node: ok},
		{name: "revoked certificate", i: 3, found: true, node: revoked, revoked: true},
		{name: "revoked node", i: 4, found: true, node: nodeRevoked, revoked: true},
		{name: "expired certificate", i: 5, found: true, node: expired},
		{name: "unknown certificate", i: 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := res[tc.i]
			require.False(t, r.Opened)
			require.Equal(t, tc.found, r.CertFound)
			require.Equal(t, tc.node, r.Cert.NodeID)
			require.Equal(t, tc.revoked, r.Cert.RevokedAt != nil)
			gw, sid, reachable, _, _ := f.session(reqs[tc.i].NodeID)
			require.Nil(t, gw)
			require.Nil(t, sid)
			require.False(t, reachable)
			require.Empty(t, f.reachableEvents(reqs[tc.i].NodeID))
		})
	}
	require.True(t, res[5].Cert.NotAfter.Equal(now), "the certificate's row as it is")
}

// TestOpenSessionsStatements: OpenSessions of 32 nodes, each with its
// certificate, on DB.AutoCommit is one statement however many sessions: it
// checks the certificates, opens the sessions and writes their
// node.reachable events, with no transaction around it. The outbox's
// NOTIFY, sent after the commit by a goroutine of its own, is not counted.
// Not parallel: the counter sees every statement of the process.
func TestOpenSessionsStatements(t *testing.T) {
	f := newGatewayFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	reqs := f.openReqs(32, "gw-a", now)
	stmts := storetest.CountStatements()
	res, err := store.OpenSessions(ctx, f.db.AutoCommit(), reqs)
	stmts.Stop()
	require.NoError(t, err)
	var sql []string
	for _, s := range stmts.SQL() {
		if !strings.Contains(s, "pg_notify") {
			sql = append(sql, s)
		}
	}
	require.Len(t, sql, 1, strings.Join(sql, "\n---\n"))
	for i, r := range res {
		require.True(t, r.Opened, reqs[i].NodeID)
		require.Len(t, f.reachableEvents(reqs[i].NodeID), 1)
	}
}

// TestOpenSessionsReachableEvents: the node.reachable events that
// OpenSessions writes in its statement hold what NodeReachableData encodes
// (previousLastSeen in time.RFC3339Nano: with its fraction, trailing zeros
// cut, none for a whole second, omitted for a node never heard; gatewayId
// omitted when empty), and are at the latest Now of the requests that made
// their nodes reachable.
func TestOpenSessionsReachableEvents(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	now := f.db.Now().Truncate(time.Second).Add(123456789 * time.Nanosecond)
	seenWhole := now.Add(-time.Hour).Truncate(time.Second)
	seenZeros := seenWhole.Add(120 * time.Millisecond)
	seenFraction := seenWhole.Add(654321 * time.Microsecond)
	type opened struct {
		node string
		seen *time.Time
		gw   string
		at   time.Time
	}
	var (
		reqs  []store.OpenSessionRequest
		cases []opened
	)
	for i, c := range []struct {
		seen *time.Time
		gw   string
	}{{nil, "gw-a"}, {&seenWhole, "gw-a"}, {&seenZeros, "gw-b"}, {&seenFraction, ""}} {
		var opts storetest.NodeOpts
		if c.seen != nil {
			opts.LastSeen = *c.seen
		}
		n := f.nodeWith(opts)
		cert := storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: n, NotAfter: now.Add(time.Hour)})
		at := now.Add(time.Duration(i) * time.Millisecond)
		reqs = append(reqs, f.openReq(n, cert.Serial, c.gw, at))
		cases = append(cases, opened{node: n, seen: c.seen, gw: c.gw, at: at})
	}
	// A node already reachable gets no event, and its later Now is not the
	// events' time.
	up := f.nodeWith(storetest.NodeOpts{LastSeen: seenWhole})
	_, err := f.db.Pool.Exec(ctx, `UPDATE nodes SET reachable = true WHERE id = $1`, up)
	require.NoError(t, err)
	upCert := storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: up, NotAfter: now.Add(time.Hour)})
	reqs = append(reqs, f.openReq(up, upCert.Serial, "gw-a", now.Add(time.Second)))

	res, err := store.OpenSessions(ctx, f.db.AutoCommit(), reqs)
	require.NoError(t, err)
	latest := cases[len(cases)-1].at
	for i, c := range cases {
		require.True(t, res[i].Opened)
		data := store.NodeReachableData{NodeID: c.node, SessionID: reqs[i].SessionID, GatewayID: c.gw}
		if c.seen != nil {
			prev := c.seen.UTC()
			data.PreviousLastSeen = &prev
		}
		want, err := json.Marshal(data)
		require.NoError(t, err)
		var (
			same      bool
			createdAt time.Time
		)
		require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT e.data = $2::jsonb, e.created_at FROM events e
			WHERE e.type = 'node.reachable' AND e.subject_id = $1`, c.node, string(want)).Scan(&same, &createdAt))
		require.True(t, same, "%s: %s", c.node, f.reachableEvents(c.node))
		require.True(t, createdAt.Equal(latest.Truncate(time.Microsecond)), "%s at %s", c.node, createdAt)
	}
	require.True(t, res[len(reqs)-1].Opened)
	require.Empty(t, f.reachableEvents(up))
}

// TestSessionOpenAndCloseUpdateInPlace: opening a session and closing it
// change no indexed column of nodes, so Postgres updates each node's row in
// place, a heap-only (HOT) update that writes no entry in any of nodes'
// indexes, when its page has room (nodes' fillfactor leaves it). Counted
// from pg_stat_xact_user_tables, before and after, in the transaction (the
// view also holds the connection's counts not yet reported).
func TestSessionOpenAndCloseUpdateInPlace(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	reqs := f.openReqs(8, "gw-a", now)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		updates := func(do func()) (all, hot int64) {
			var all0, hot0 int64
			const counts = `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relid = 'nodes'::regclass`
			require.NoError(t, tx.QueryRow(ctx, counts).Scan(&all0, &hot0))
			do()
			require.NoError(t, tx.QueryRow(ctx, counts).Scan(&all, &hot))
			return all - all0, hot - hot0
		}
		all, hot := updates(func() {
			res, err := store.OpenSessions(ctx, tx, reqs)
			require.NoError(t, err)
			for _, r := range res {
				require.True(t, r.Opened)
			}
		})
		require.EqualValues(t, len(reqs), all, "one update per node opened")
		require.Equal(t, all, hot, "opens updated in place")
		all, hot = updates(func() {
			for _, r := range reqs {
				closed, err := store.CloseSession(ctx, tx, now, r.NodeID, r.SessionID, now)
				require.NoError(t, err)
				require.True(t, closed)
			}
		})
		require.EqualValues(t, len(reqs), all, "one update per node closed")
		require.Equal(t, all, hot, "closes updated in place")
		return nil
	}))
}

func TestGetSessionCert(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	n := f.node()
	now := f.db.Now()
	storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: n, Serial: "0abc", NotAfter: now.Add(time.Hour), RevokedAt: now})
	c, err := store.GetSessionCert(t.Context(), f.db.Pool, "0abc")
	require.NoError(t, err)
	require.Equal(t, n, c.NodeID)
	require.NotNil(t, c.RevokedAt)
	require.True(t, c.NotAfter.Equal(now.Add(time.Hour)))
	_, err = store.GetSessionCert(t.Context(), f.db.Pool, "ffff")
	require.ErrorIs(t, err, store.ErrNotFound)
}

// claim runs ClaimSessionDeliveries for one session.
func (f gatewayFixture) claim(nodeID, sid string, known int64, inFlight bool) store.SessionDelivery {
	f.t.Helper()
	d, err := store.ClaimSessionDeliveries(f.t.Context(), f.db.Pool, f.db.Now(),
		[]store.ClaimRequest{{NodeID: nodeID, SessionID: sid, Known: known, InFlight: inFlight}})
	require.NoError(f.t, err)
	require.Len(f.t, d, 1)
	return d[0]
}

func (f gatewayFixture) commandState(id string) (state string, deliveries int) {
	f.t.Helper()
	require.NoError(f.t, f.db.Pool.QueryRow(context.Background(), `SELECT state, deliveries FROM commands WHERE id = $1`, id).
		Scan(&state, &deliveries))
	return state, deliveries
}

func commandIDs(d store.SessionDelivery) []string {
	var got []string
	for _, c := range d.Commands {
		got = append(got, c.ID)
	}
	return got
}

func TestClaimSessionDelivery(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	n := f.nodeWith(storetest.NodeOpts{SpecGeneration: 2, Spec: `{"labels": {"a": "b"}}`})
	base := f.db.Now()
	queued2 := f.command(n, "queued", "user", base.Add(2*time.Second))
	queued1 := f.command(n, "queued", "user", base.Add(time.Second))
	running := f.command(n, "running", "user", base)
	f.command(n, "succeeded", "user", base)
	sid, _ := f.open(n, "gw-a", 0)

	// A new session gets the in-flight ones too, oldest first, and the spec.
	d := f.claim(n, sid, 0, true)
	require.True(t, d.Current)
	require.EqualValues(t, 2, d.SpecGeneration)
	require.JSONEq(t, `{"labels": {"a": "b"}}`, string(d.Spec))
	require.Equal(t, []string{running, queued1, queued2}, commandIDs(d))
	state, deliveries := f.commandState(running)
	require.Equal(t, "running", state)
	require.Equal(t, 1, deliveries)
	state, _ = f.commandState(queued1)
	require.Equal(t, "delivered", state)

	// Later wakes take only queued commands; the spec is left out when the
	// session knows its generation.
	d = f.claim(n, sid, 2, false)
	require.True(t, d.Current)
	require.Empty(t, d.Commands)
	require.Nil(t, d.Spec)

	// A superseded session claims nothing.
	q := f.command(n, "queued", "user", f.db.Now())
	f.open(n, "gw-b", 0)
	d = f.claim(n, sid, 0, true)
	require.False(t, d.Current)
	require.Empty(t, d.Commands)
	require.Nil(t, d.Spec)
	state, _ = f.commandState(q)
	require.Equal(t, "queued", state)
}

// TestClaimSessionDeliveries: one call serves several sessions, each as if
// alone: a live session gets its node's commands only, a superseded one
// (even beside its node's live session in the same call) and a revoked
// node get nothing, an unknown node is not current, and the results come in
// the requests' order.
func TestClaimSessionDeliveries(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	a := f.node()
	b := f.nodeWith(storetest.NodeOpts{SpecGeneration: 3, Spec: `{"labels": {"n": "b"}}`})
	taken := f.nodeWith(storetest.NodeOpts{SpecGeneration: 1, Spec: `{}`})
	revoked := f.nodeWith(storetest.NodeOpts{SpecGeneration: 1, Spec: `{}`})
	base := f.db.Now()
	a2 := f.command(a, "queued", "user", base.Add(time.Second))
	a1 := f.command(a, "queued", "user", base)
	aRunning := f.command(a, "running", "user", base.Add(-time.Second))
	b1 := f.command(b, "queued", "user", base)
	bDelivered := f.command(b, "delivered", "user", base)
	t1 := f.command(taken, "queued", "user", base)
	r1 := f.command(revoked, "queued", "user", base)
	sa, _ := f.open(a, "gw", 0)
	sb, _ := f.open(b, "gw", 0)
	oldTaken, _ := f.open(taken, "gw", 0)
	newTaken, _ := f.open(taken, "gw", 0)
	sr, _ := f.open(revoked, "gw", 0)
	// Revoked after its session opened; its queued command is left as it
	// is (store.RevokeNode would fail it) to show the claim skips it.
	_, err := f.db.Pool.Exec(ctx, `UPDATE nodes SET revoked_at = $2 WHERE id = $1`, revoked, f.db.Now())
	require.NoError(t, err)

	ds, err := store.ClaimSessionDeliveries(ctx, f.db.Pool, f.db.Now(), []store.ClaimRequest{
		{NodeID: a, SessionID: sa, InFlight: true},
		{NodeID: taken, SessionID: oldTaken, InFlight: true},
		{NodeID: b, SessionID: sb, Known: 1},
		{NodeID: revoked, SessionID: sr, InFlight: true},
		{NodeID: "node_gone", SessionID: "ses_x", InFlight: true},
		{NodeID: taken, SessionID: newTaken, Known: 1},
	})
	require.NoError(t, err)
	require.Len(t, ds, 6)

	require.True(t, ds[0].Current)
	require.Equal(t, []string{aRunning, a1, a2}, commandIDs(ds[0]))
	require.Nil(t, ds[0].Spec, "a's spec generation 0 is not above 0")

	require.False(t, ds[1].Current, "the superseded session")
	require.Empty(t, ds[1].Commands)
	require.Nil(t, ds[1].Spec)

	require.True(t, ds[2].Current)
	require.Equal(t, []string{b1}, commandIDs(ds[2]), "without InFlight the delivered command is not resent")
	require.EqualValues(t, 3, ds[2].SpecGeneration)
	require.JSONEq(t, `{"labels": {"n": "b"}}`, string(ds[2].Spec))

	require.True(t, ds[3].Revoked)
	require.Empty(t, ds[3].Commands)
	require.Nil(t, ds[3].Spec)

	require.Equal(t, store.SessionDelivery{}, ds[4], "an unknown node is not current")

	require.True(t, ds[5].Current, "the live session beside its superseded one")
	require.Equal(t, []string{t1}, commandIDs(ds[5]))
	require.Nil(t, ds[5].Spec, "it knows generation 1")

	for id, want := range map[string]string{a1: "delivered", a2: "delivered", aRunning: "running", b1: "delivered",
		bDelivered: "delivered", t1: "delivered", r1: "queued"} {
		state, deliveries := f.commandState(id)
		require.Equal(t, want, state, id)
		wantDeliveries := 1
		if id == bDelivered || id == r1 {
			wantDeliveries = 0
		}
		require.Equal(t, wantDeliveries, deliveries, id)
	}

	ds, err = store.ClaimSessionDeliveries(ctx, f.db.Pool, f.db.Now(), nil)
	require.NoError(t, err)
	require.Empty(t, ds)
}

// applyUpdates runs ApplySessionCommandUpdates in a transaction.
func (f gatewayFixture) applyUpdates(us ...store.SessionCommandUpdate) []store.SessionCommandUpdated {
	f.t.Helper()
	var out []store.SessionCommandUpdated
	require.NoError(f.t, f.db.InTx(f.t.Context(), func(tx pgx.Tx) error {
		var err error
		out, err = store.ApplySessionCommandUpdates(f.t.Context(), tx, us)
		return err
	}))
	require.Len(f.t, out, len(us))
	return out
}

// ofCommands checks that each applied update of out names its command's
// kind and queueing time (kind, createdAt: the commands of these tests share
// them), and returns out without them, to compare the rest.
func ofCommands(t *testing.T, out []store.SessionCommandUpdated, kind string, createdAt time.Time) []store.SessionCommandUpdated {
	t.Helper()
	rest := make([]store.SessionCommandUpdated, len(out))
	for i, u := range out {
		if u.Applied {
			require.Equal(t, kind, u.Kind, "update %d", i)
			require.True(t, u.CreatedAt.Equal(createdAt), "update %d: created at %s, want %s", i, u.CreatedAt, createdAt)
		} else {
			require.Empty(t, u.Kind, "update %d", i)
			require.Zero(t, u.CreatedAt, "update %d", i)
		}
		u.Kind, u.CreatedAt = "", time.Time{}
		rest[i] = u
	}
	return rest
}

func TestApplySessionCommandUpdate(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n, other := f.node(), f.node()
	created := f.db.Now()
	c := f.command(n, "delivered", "acceptance", created)
	apply := func(node, id, state string, result []byte, errText string) store.SessionCommandUpdated {
		t.Helper()
		return ofCommands(t, f.applyUpdates(store.SessionCommandUpdate{
			NodeID: node, CommandID: id, State: state, Result: result, Error: errText, Now: f.db.Now()}), store.CommandDiagNVML, created)[0]
	}
	require.Equal(t, store.SessionCommandUpdated{Applied: true, Acceptance: true, State: "running"}, apply(n, c, "running", nil, ""))
	require.False(t, apply(n, c, "delivered", nil, "").Applied, "never backward")
	require.False(t, apply(other, c, "succeeded", nil, "").Applied, "another node's command")
	require.False(t, apply(n, "cmd_missing", "succeeded", nil, "").Applied)
	require.Equal(t, store.SessionCommandUpdated{Applied: true, Acceptance: true, Terminal: true, State: "succeeded"},
		apply(n, c, "succeeded", []byte(`{"output":"ok"}`), ""))
	require.False(t, apply(n, c, "failed", nil, "late").Applied, "never out of a terminal state")

	var state, errText string
	var result []byte
	var finished *time.Time
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT state, result, error, finished_at FROM commands WHERE id = $1`, c).
		Scan(&state, &result, &errText, &finished))
	require.Equal(t, "succeeded", state)
	require.JSONEq(t, `{"output":"ok"}`, string(result))
	require.Empty(t, errText)
	require.NotNil(t, finished)

	_, err := store.ApplySessionCommandUpdates(ctx, f.db.Pool, []store.SessionCommandUpdate{
		{NodeID: n, CommandID: c, State: "canceled", Now: f.db.Now()}})
	require.Error(t, err, "a daemon cannot cancel")
}

// TestApplySessionCommandUpdates: one batch applies each command's updates
// in order (forward only, several of one command included), ignores a
// foreign node's command, writes each terminal user command's event once
// and pokes the controllers once for the acceptance checks that ended.
func TestApplySessionCommandUpdates(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n, m, acc1, acc2 := f.node(), f.node(), f.node(), f.node()
	base := f.db.Now()
	x := f.command(n, "delivered", "user", base)       // running, succeeded, failed, running: succeeds
	y := f.command(n, "running", "user", base)         // delivered, then failed: fails
	z := f.command(n, "delivered", "user", base)       // running twice: runs
	foreign := f.command(m, "delivered", "user", base) // reported by n: ignored
	done := f.command(n, "succeeded", "user", base)    // already terminal
	a1 := f.command(acc1, "delivered", "acceptance", base)
	a2 := f.command(acc2, "running", "acceptance", base)
	var before int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&before))

	now := f.db.Now()
	u := func(node, id, state, errText string, result []byte) store.SessionCommandUpdate {
		return store.SessionCommandUpdate{NodeID: node, CommandID: id, State: state, Error: errText, Result: result, Now: now}
	}
	out := f.applyUpdates(
		u(n, x, "running", "", nil),
		u(n, y, "delivered", "", nil),
		u(n, x, "succeeded", "", []byte(`{"output":"ok"}`)),
		u(n, z, "running", "", nil),
		u(n, foreign, "succeeded", "", nil),
		u(n, x, "failed", "late", nil),
		u(acc1, a1, "failed", "no gpu", nil),
		u(n, y, "failed", "boom", nil),
		u(n, done, "failed", "again", nil),
		u(n, z, "running", "", nil),
		u(acc2, a2, "succeeded", "", nil),
		u(n, x, "running", "", nil),
	)
	running := store.SessionCommandUpdated{Applied: true, State: "running"}
	succeeded := store.SessionCommandUpdated{Applied: true, Terminal: true, State: "succeeded"}
	failed := store.SessionCommandUpdated{Applied: true, Terminal: true, State: "failed"}
	accFailed := store.SessionCommandUpdated{Applied: true, Terminal: true, Acceptance: true, State: "failed"}
	accSucceeded := store.SessionCommandUpdated{Applied: true, Terminal: true, Acceptance: true, State: "succeeded"}
	require.Equal(t, []store.SessionCommandUpdated{
		running, {}, succeeded, running, {}, {}, accFailed, failed, {}, {}, accSucceeded, {},
	}, ofCommands(t, out, store.CommandDiagNVML, base))

	type row struct {
		State, Error string
		Result       []byte
		Finished     *time.Time
	}
	get := func(id string) row {
		t.Helper()
		var r row
		require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT state, error, result, finished_at FROM commands WHERE id = $1`, id).
			Scan(&r.State, &r.Error, &r.Result, &r.Finished))
		return r
	}
	rx := get(x)
	require.Equal(t, "succeeded", rx.State, "the first terminal update wins")
	require.Empty(t, rx.Error, "the later failure's error is not stored")
	require.JSONEq(t, `{"output":"ok"}`, string(rx.Result))
	require.NotNil(t, rx.Finished)
	require.Equal(t, "failed", get(y).State)
	require.Equal(t, "boom", get(y).Error)
	require.Equal(t, "running", get(z).State)
	require.Nil(t, get(z).Finished)
	require.Equal(t, "delivered", get(foreign).State)
	require.Equal(t, "succeeded", get(done).State)
	require.Equal(t, "failed", get(a1).State)
	require.Equal(t, "succeeded", get(a2).State)

	type ev struct{ Type, Subject string }
	rows, err := f.db.Pool.Query(ctx, `SELECT type, subject_id FROM events WHERE type LIKE 'command.%' ORDER BY id`)
	require.NoError(t, err)
	evs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ev])
	require.NoError(t, err)
	require.Equal(t, []ev{{"command.succeeded", x}, {"command.failed", y}}, evs,
		"one event per terminal user command, none for acceptance checks")
	// The failed one says why.
	var data []byte
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT data FROM events WHERE subject_id = $1`, y).Scan(&data))
	require.JSONEq(t, `{"commandId": "`+y+`", "nodeId": "`+n+`", "kind": "diag.nvml", "state": "failed", "error": "boom"}`,
		string(data))

	rows, err = f.db.Pool.Query(ctx, `SELECT subject, payload FROM outbox WHERE subject = $1`, store.SubjectPokeControllers)
	require.NoError(t, err)
	type msg struct {
		Subject string
		Payload []byte
	}
	pokes, err := pgx.CollectRows(rows, pgx.RowToStructByPos[msg])
	require.NoError(t, err)
	require.Len(t, pokes, 1, "one controllers poke per batch")
	require.JSONEq(t, `{"nodeIds": ["`+acc1+`", "`+acc2+`"]}`, string(pokes[0].Payload))
	var after int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&after))
	require.Equal(t, before+1, after, "one poke; the events have no outbox rows")

	// A batch of only non-terminal updates needs no transaction.
	w := f.command(n, "delivered", "user", base)
	out, err = store.ApplySessionCommandUpdates(ctx, f.db.Pool, []store.SessionCommandUpdate{u(n, w, "running", "", nil)})
	require.NoError(t, err)
	require.Equal(t, []store.SessionCommandUpdated{running}, ofCommands(t, out, store.CommandDiagNVML, base))
	require.Equal(t, "running", get(w).State)

	// An invalid state fails the whole batch, writing nothing.
	v := f.command(n, "delivered", "user", base)
	_, err = store.ApplySessionCommandUpdates(ctx, f.db.Pool, []store.SessionCommandUpdate{
		u(n, v, "running", "", nil), u(n, v, "queued", "", nil)})
	require.Error(t, err)
	require.Equal(t, "delivered", get(v).State)
}

func TestRecordSessionLastSeenAndObserved(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	// Both hold a live session on gw but are unreachable (the sweeper
	// marked them).
	sa := "ses_a"
	a := f.nodeWith(storetest.NodeOpts{GatewayID: "gw", SessionID: sa})
	b := f.nodeWith(storetest.NodeOpts{GatewayID: "gw", SessionID: "ses_b"})
	at := f.db.Now().Add(time.Minute)
	n, err := store.RecordSessionLastSeen(ctx, f.db.Pool, []store.SessionLastSeen{
		{NodeID: b, SessionID: "ses_old", At: at, ObservedGeneration: 4},
		{NodeID: a, SessionID: sa, At: at, ObservedGeneration: 2},
		{NodeID: "node_gone", SessionID: "x", At: at},
	})
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	_, _, reachable, lastSeen, observed := f.session(a)
	require.True(t, reachable)
	require.True(t, lastSeen.Equal(at))
	require.EqualValues(t, 2, observed)
	_, _, reachable, lastSeen, observed = f.session(b)
	require.False(t, reachable, "only the live session makes a node reachable")
	require.True(t, lastSeen.Equal(at))
	require.EqualValues(t, 4, observed)

	// Older values never lower newer ones.
	_, err = store.RecordSessionLastSeen(ctx, f.db.Pool, []store.SessionLastSeen{{NodeID: a, SessionID: sa, At: at.Add(-time.Hour), ObservedGeneration: 1}})
	require.NoError(t, err)
	_, _, _, lastSeen, observed = f.session(a)
	require.True(t, lastSeen.Equal(at))
	require.EqualValues(t, 2, observed)

	// Reported generations: the greatest per node, never lower.
	raised, err := store.RecordSessionObservedGenerations(ctx, f.db.Pool, f.db.Now(), []store.ObservedGeneration{
		{NodeID: a, Generation: 5}, {NodeID: b, Generation: 3}, {NodeID: a, Generation: 4}, {NodeID: "node_gone", Generation: 9},
	})
	require.NoError(t, err)
	require.EqualValues(t, 1, raised, "b's 3 is below its 4")
	_, _, _, _, observed = f.session(a)
	require.EqualValues(t, 5, observed)
	_, _, _, _, observed = f.session(b)
	require.EqualValues(t, 4, observed)
	raised, err = store.RecordSessionObservedGenerations(ctx, f.db.Pool, f.db.Now(), []store.ObservedGeneration{
		{NodeID: a, Generation: 3}, {NodeID: b, Generation: 6}})
	require.NoError(t, err)
	require.EqualValues(t, 1, raised)
	_, _, _, _, observed = f.session(a)
	require.EqualValues(t, 5, observed)
	_, _, _, _, observed = f.session(b)
	require.EqualValues(t, 6, observed)
	raised, err = store.RecordSessionObservedGenerations(ctx, f.db.Pool, f.db.Now(), nil)
	require.NoError(t, err)
	require.Zero(t, raised)
}

func TestPendingSessionWork(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	idle, queued, taken := f.node(), f.node(), f.node()
	spec := f.nodeWith(storetest.NodeOpts{SpecGeneration: 2, ObservedGeneration: 1})
	sIdle, _ := f.open(idle, "gw", 0)
	sQueued, _ := f.open(queued, "gw", 0)
	sSpec, _ := f.open(spec, "gw", 0)
	sTaken, _ := f.open(taken, "gw", 0)
	f.open(taken, "gw-other", 0)
	f.command(queued, "queued", "user", f.db.Now())
	f.command(idle, "running", "user", f.db.Now())

	work, err := store.PendingSessionWork(ctx, f.db.Pool, []store.SessionRef{
		{NodeID: idle, SessionID: sIdle}, {NodeID: queued, SessionID: sQueued},
		{NodeID: spec, SessionID: sSpec}, {NodeID: taken, SessionID: sTaken},
		{NodeID: "node_gone", SessionID: "ses_x"},
	})
	require.NoError(t, err)
	byNode := map[string]store.SessionWork{}
	for _, w := range work {
		byNode[w.NodeID] = w
	}
	require.Len(t, byNode, 4)
	require.NotContains(t, byNode, idle)
	require.True(t, byNode[queued].Queued)
	require.False(t, byNode[queued].Superseded)
	require.EqualValues(t, 2, byNode[spec].SpecGeneration)
	require.EqualValues(t, 1, byNode[spec].ObservedGeneration)
	require.False(t, byNode[spec].Queued)
	require.True(t, byNode[taken].Superseded)
	require.True(t, byNode["node_gone"].Superseded)

	work, err = store.PendingSessionWork(ctx, f.db.Pool, nil)
	require.NoError(t, err)
	require.Empty(t, work)
}

// TestPendingSessionWorkReadsOnlyOpenCommands: the gateway's periodic
// re-read of its sessions' work, and its claim of their deliveries, must
// find queued commands through the open-command index, not by reading every
// command a node ever ran (a gateway of 1,000 busy nodes spent most of a
// second per re-read).
func TestPendingSessionWorkReadsOnlyOpenCommands(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	var refs []store.SessionRef
	var nodeIDs, sids, serials, renewed []string
	for range 20 {
		n := f.node()
		sid, _ := f.open(n, "gw", 0)
		refs = append(refs, store.SessionRef{NodeID: n, SessionID: sid})
		nodeIDs, sids, serials, renewed = append(nodeIDs, n), append(sids, sid), append(serials, ""), append(renewed, "")
	}
	// A long history of finished commands and one queued command.
	for _, n := range nodeIDs {
		for i := range 200 {
			storetest.Command(t, f.db, &storetest.CommandOpts{ID: fmt.Sprintf("cmd_hist_%s_%d", n, i), NodeID: n, State: "succeeded",
				RetrySafe: new(bool), Deadline: f.db.Now()})
		}
	}
	queued := f.command(nodeIDs[0], "queued", "user", f.db.Now())
	_, err := f.db.Pool.Exec(ctx, `ANALYZE commands`)
	require.NoError(t, err)

	work, err := store.PendingSessionWork(ctx, f.db.Pool, refs)
	require.NoError(t, err)
	require.Len(t, work, 1, "only the node with queued command %s has work", queued)
	require.Equal(t, nodeIDs[0], work[0].NodeID)
	require.True(t, work[0].Queued)

	rows, err := f.db.Pool.Query(ctx, "EXPLAIN "+store.PendingSessionWorkSQL, nodeIDs, sids, serials, renewed)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")
	require.Contains(t, plan, "commands_open_idx", "queued commands are found through the open-command index:\n%s", plan)
	require.NotContains(t, plan, "commands_node_request_idx", "no read of a node's whole command history:\n%s", plan)
	require.NotContains(t, plan, "Seq Scan on commands", "no read of the whole commands table:\n%s", plan)

	// The claim of the sessions' deliveries reads the same open commands.
	known, inFlight := make([]int64, len(nodeIDs)), make([]bool, len(nodeIDs))
	rows, err = f.db.Pool.Query(ctx, "EXPLAIN "+store.ClaimSessionDeliveriesSQL, nodeIDs, sids, known, inFlight, f.db.Now())
	require.NoError(t, err)
	lines, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan = strings.Join(lines, "\n")
	require.Contains(t, plan, "commands_open_idx", "the claim finds open commands through the open-command index:\n%s", plan)
	require.NotContains(t, plan, "commands_node_request_idx", "the claim reads no node's whole command history:\n%s", plan)
	require.NotContains(t, plan, "Seq Scan on commands", "the claim reads not the whole commands table:\n%s", plan)
}

// TestClaimGenericPlanReadsByNode: the claim runs with a generic plan
// (DB.AutoCommit), made once per connection, maybe while commands_open_idx
// is empty; planned then, a claim must still read only the claimed nodes'
// open commands once thousands of other commands are open: the index's
// condition is the nodes, and no join filter drops the other nodes' rows.
// (A join of the nodes with commands was planned, on an empty index, as a
// scan of the whole index per node, filtered by node: 1.2 million buffers
// read by one claim of 256 nodes under load.)
func TestClaimGenericPlanReadsByNode(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	conn, err := f.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	// AutoCommit's settings (store.Open), on a connection this test holds.
	for _, set := range []string{"plan_cache_mode = force_generic_plan", "enable_seqscan = off", "jit = off"} {
		_, err := conn.Exec(ctx, "SET "+set)
		require.NoError(t, err)
	}
	_, err = conn.Exec(ctx, "PREPARE claim(text[], text[], bigint[], bool[], timestamptz) AS "+store.ClaimSessionDeliveriesSQL)
	require.NoError(t, err)
	// The generic plan is made at the first execution, with no open command.
	_, err = conn.Exec(ctx, "EXPLAIN EXECUTE claim('{}', '{}', '{}', '{}', now())")
	require.NoError(t, err)

	var nodeIDs, sids []string
	for range 20 {
		n := f.node()
		sid, _ := f.open(n, "gw", 0)
		nodeIDs, sids = append(nodeIDs, n), append(sids, sid)
		for range 30 {
			f.command(n, "queued", "user", f.db.Now())
		}
	}
	claimed := nodeIDs[:2]
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, COSTS OFF) EXECUTE claim($1, $2, $3, $4, $5)",
		pgx.QueryExecModeSimpleProtocol, claimed, sids[:2], []int64{0, 0}, []bool{false, false}, f.db.Now())
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")
	require.Contains(t, plan, "Index Scan using commands_open_idx on commands", plan)
	require.Regexp(t, `commands_open_idx on commands c[^\n]*\n\s+Index Cond: \(node_id = ANY`, plan,
		"the open commands are read by the claimed nodes")
	require.NotContains(t, plan, "Rows Removed by Join Filter", "no other node's open command is read")
	require.Contains(t, plan, "rows=60 loops=1", "the claimed nodes' 60 commands, once:\n%s", plan)
}
