package store_test

import (
	"context"
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
	now := db.Now()
	f := gatewayFixture{t: t, db: db, poolID: ids.New(ids.Pool, now)}
	ten, site := ids.New(ids.Tenant, now), ids.New(ids.Site, now)
	f.exec(`INSERT INTO tenants (id, name, created_at) VALUES ($1, 'gw-acme', $2)`, ten, now)
	f.exec(`INSERT INTO sites (id, name, created_at) VALUES ($1, 'gw-site', $2)`, site, now)
	f.exec(`INSERT INTO pools (id, site_id, owner_tenant_id, name, kind, created_at) VALUES ($1, $2, $3, 'p', 'metal-host', $4)`,
		f.poolID, site, ten, now)
	return f
}

func (f gatewayFixture) exec(sql string, args ...any) {
	f.t.Helper()
	_, err := f.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(f.t, err)
}

func (f gatewayFixture) node() string {
	f.t.Helper()
	now := f.db.Now()
	id := ids.New(ids.Node, now)
	f.exec(`INSERT INTO nodes (id, pool_id, provision_state, created_at, updated_at) VALUES ($1, $2, 'accepting', $3, $3)`, id, f.poolID, now)
	return id
}

func (f gatewayFixture) command(nodeID, state, purpose string, createdAt time.Time) string {
	f.t.Helper()
	id := ids.New(ids.Command, createdAt)
	f.exec(`INSERT INTO commands (id, node_id, kind, purpose, state, retry_safe, deadline, created_at, updated_at)
		VALUES ($1, $2, 'diag.nvml', $3, $4, false, $5, $5, $5)`, id, nodeID, purpose, state, createdAt)
	return id
}

func (f gatewayFixture) open(nodeID, gw string, observed int64) (string, store.OpenedSession) {
	f.t.Helper()
	sid := ids.New(ids.Session, f.db.Now())
	o, err := store.OpenSession(context.Background(), f.db.Pool, store.OpenSessionParams{
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
	n := f.node()
	f.exec(`UPDATE nodes SET spec_generation = 3, observed_generation = 2 WHERE id = $1`, n)

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

	_, err = store.OpenSession(ctx, f.db.Pool, store.OpenSessionParams{NodeID: "node_missing", GatewayID: "g", SessionID: "s", Now: f.db.Now()})
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestGetSessionCert(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	n := f.node()
	now := f.db.Now()
	f.exec(`INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, revoked_at, created_at)
		VALUES ('0abc', $1, '\x00', $2, $3, $2, $2)`, n, now, now.Add(time.Hour))
	c, err := store.GetSessionCert(t.Context(), f.db.Pool, "0abc")
	require.NoError(t, err)
	require.Equal(t, n, c.NodeID)
	require.NotNil(t, c.RevokedAt)
	require.True(t, c.NotAfter.Equal(now.Add(time.Hour)))
	_, err = store.GetSessionCert(t.Context(), f.db.Pool, "ffff")
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestClaimSessionDelivery(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n := f.node()
	base := f.db.Now()
	queued2 := f.command(n, "queued", "user", base.Add(2*time.Second))
	queued1 := f.command(n, "queued", "user", base.Add(time.Second))
	running := f.command(n, "running", "user", base)
	f.command(n, "succeeded", "user", base)
	f.exec(`UPDATE nodes SET spec_generation = 2, spec = '{"labels": {"a": "b"}}' WHERE id = $1`, n)
	sid, _ := f.open(n, "gw-a", 0)

	// A new session gets the in-flight ones too, oldest first, and the spec.
	d, err := store.ClaimSessionDelivery(ctx, f.db.Pool, f.db.Now(), n, sid, 0, true)
	require.NoError(t, err)
	require.True(t, d.Current)
	require.EqualValues(t, 2, d.SpecGeneration)
	require.JSONEq(t, `{"labels": {"a": "b"}}`, string(d.Spec))
	var got []string
	for _, c := range d.Commands {
		got = append(got, c.ID)
	}
	require.Equal(t, []string{running, queued1, queued2}, got)
	var state string
	var deliveries int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT state, deliveries FROM commands WHERE id = $1`, running).Scan(&state, &deliveries))
	require.Equal(t, "running", state)
	require.Equal(t, 1, deliveries)
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT state, deliveries FROM commands WHERE id = $1`, queued1).Scan(&state, &deliveries))
	require.Equal(t, "delivered", state)

	// Later wakes take only queued commands; the spec is left out when the
	// session knows its generation.
	d, err = store.ClaimSessionDelivery(ctx, f.db.Pool, f.db.Now(), n, sid, 2, false)
	require.NoError(t, err)
	require.True(t, d.Current)
	require.Empty(t, d.Commands)
	require.Nil(t, d.Spec)

	// A superseded session claims nothing.
	q := f.command(n, "queued", "user", f.db.Now())
	f.open(n, "gw-b", 0)
	d, err = store.ClaimSessionDelivery(ctx, f.db.Pool, f.db.Now(), n, sid, 0, true)
	require.NoError(t, err)
	require.False(t, d.Current)
	require.Empty(t, d.Commands)
	require.Nil(t, d.Spec)
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT state FROM commands WHERE id = $1`, q).Scan(&state))
	require.Equal(t, "queued", state)
}

func TestApplySessionCommandUpdate(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n, other := f.node(), f.node()
	c := f.command(n, "delivered", "acceptance", f.db.Now())
	apply := func(node, id, state string, result []byte, errText string) store.SessionCommandUpdated {
		t.Helper()
		var out store.SessionCommandUpdated
		require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			out, err = store.ApplySessionCommandUpdate(ctx, tx, store.SessionCommandUpdate{
				NodeID: node, CommandID: id, State: state, Result: result, Error: errText, Now: f.db.Now()})
			return err
		}))
		return out
	}
	require.Equal(t, store.SessionCommandUpdated{Applied: true, Acceptance: true}, apply(n, c, "running", nil, ""))
	require.False(t, apply(n, c, "delivered", nil, "").Applied, "never backward")
	require.False(t, apply(other, c, "succeeded", nil, "").Applied, "another node's command")
	require.False(t, apply(n, "cmd_missing", "succeeded", nil, "").Applied)
	require.Equal(t, store.SessionCommandUpdated{Applied: true, Acceptance: true, Terminal: true},
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

	_, err := store.ApplySessionCommandUpdate(ctx, f.db.Pool, store.SessionCommandUpdate{NodeID: n, CommandID: c, State: "canceled", Now: f.db.Now()})
	require.Error(t, err, "a daemon cannot cancel")
}

func TestRecordSessionLastSeenAndObserved(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	a, b := f.node(), f.node()
	sa, _ := f.open(a, "gw", 0)
	f.open(b, "gw", 0)
	f.exec(`UPDATE nodes SET reachable = false`)
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

	changed, err := store.RecordSessionObservedGeneration(ctx, f.db.Pool, f.db.Now(), a, 5)
	require.NoError(t, err)
	require.True(t, changed)
	changed, err = store.RecordSessionObservedGeneration(ctx, f.db.Pool, f.db.Now(), a, 3)
	require.NoError(t, err)
	require.False(t, changed)
}

func TestPendingSessionWork(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	idle, queued, spec, taken := f.node(), f.node(), f.node(), f.node()
	sIdle, _ := f.open(idle, "gw", 0)
	sQueued, _ := f.open(queued, "gw", 0)
	sSpec, _ := f.open(spec, "gw", 0)
	sTaken, _ := f.open(taken, "gw", 0)
	f.open(taken, "gw-other", 0)
	f.command(queued, "queued", "user", f.db.Now())
	f.command(idle, "running", "user", f.db.Now())
	f.exec(`UPDATE nodes SET spec_generation = 2, observed_generation = 1 WHERE id = $1`, spec)

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
