package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// cert records a node certificate with serial, valid until notAfter and
// revoked at revokedAt (never when zero).
func (f gatewayFixture) cert(nodeID, serial string, notAfter, revokedAt time.Time) {
	f.t.Helper()
	storetest.NodeCert(f.t, f.db, &storetest.NodeCertOpts{NodeID: nodeID, Serial: serial, NotAfter: notAfter, RevokedAt: revokedAt})
}

func (f gatewayFixture) certRevokedAt(serial string) *time.Time {
	f.t.Helper()
	var at *time.Time
	require.NoError(f.t, f.db.Pool.QueryRow(context.Background(), `SELECT revoked_at FROM node_certs WHERE serial = $1`, serial).Scan(&at))
	return at
}

func (f gatewayFixture) revoke(nodeID, reason string) store.RevokedNode {
	f.t.Helper()
	var out store.RevokedNode
	require.NoError(f.t, f.db.InTx(context.Background(), func(tx pgx.Tx) error {
		var err error
		out, err = store.RevokeNode(context.Background(), tx, store.AllTenants, f.db.Now(), nodeID, reason)
		return err
	}))
	return out
}

func TestRevokeNode(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n, bystander := f.node(), f.node()
	now := f.db.Now()
	f.cert(n, "01", now.Add(time.Hour), now.Add(-time.Minute))
	f.cert(n, "02", now.Add(2*time.Hour), time.Time{})
	f.cert(bystander, "03", now.Add(time.Hour), time.Time{})
	f.open(n, "gw-a", 0)
	queued := f.command(n, "queued", "user", now.Add(-2*time.Second))
	running := f.command(n, "running", "user", now.Add(-time.Second))
	acceptance := f.command(n, "delivered", "acceptance", now.Add(-time.Second))
	done := f.command(n, "succeeded", "user", now.Add(-3*time.Second))
	elsewhere := f.command(bystander, "queued", "user", now.Add(-time.Second))

	before, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, n)
	require.NoError(t, err)
	require.Nil(t, before.RevokedAt)
	require.NotNil(t, before.CertNotAfter)
	require.True(t, before.CertNotAfter.Equal(now.Add(2*time.Hour)), "the newest certificate's expiry")

	rev := f.revoke(n, "stolen")
	require.True(t, rev.Newly)
	require.Equal(t, 1, rev.CertificatesRevoked, "the certificate not yet revoked")
	require.True(t, f.certRevokedAt("01").Equal(now.Add(-time.Minute)), "an earlier revocation is kept")
	require.NotNil(t, f.certRevokedAt("02"))
	require.Nil(t, f.certRevokedAt("03"), "other nodes' certificates are untouched")
	after, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, n)
	require.NoError(t, err)
	require.NotNil(t, after.RevokedAt)
	require.True(t, after.RevokedAt.Equal(rev.RevokedAt))
	require.Equal(t, "stolen", rev.Reason)
	require.Equal(t, "stolen", after.RevokeReason, "the node records why it was revoked")

	// The gateway holding the session is poked in the same transaction,
	// and the pool owner's tenant gets an event.
	var payload []byte
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT payload FROM outbox WHERE subject = $1`, store.SubjectPokeGatewayPrefix+"gw-a").Scan(&payload))
	var poke store.Poke
	require.NoError(t, json.Unmarshal(payload, &poke))
	require.Equal(t, []string{n}, poke.NodeIDs)
	var events int
	var data []byte
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*), max(data::text) FROM events WHERE type = $1 AND subject_id = $2
		AND tenant_id IS NOT NULL`, store.EventNodeRevoked, n).Scan(&events, &data))
	require.Equal(t, 1, events)
	require.JSONEq(t, `{"nodeId": "`+n+`", "reason": "stolen", "certificatesRevoked": 1}`, string(data))

	// Its open commands fail (the session will not open again); finished
	// ones and other nodes' are untouched; user commands get their event.
	want := []string{queued, running, acceptance}
	slices.Sort(want)
	require.Equal(t, want, rev.CommandsFailed)
	for _, id := range want {
		state, _ := f.commandState(id)
		require.Equal(t, "failed", state, id)
	}
	for id, st := range map[string]string{done: "succeeded", elsewhere: "queued"} {
		state, _ := f.commandState(id)
		require.Equal(t, st, state, id)
	}
	var failedErr string
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT error FROM commands WHERE id = $1`, running).Scan(&failedErr))
	require.Equal(t, store.CommandErrTextNodeRevoked, failedErr)
	var subjects []string
	rows, err := f.db.Pool.Query(ctx, `SELECT subject_id FROM events WHERE type = $1 ORDER BY subject_id`, store.EventCommandFailed)
	require.NoError(t, err)
	subjects, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	userFailed := []string{queued, running}
	slices.Sort(userFailed)
	require.Equal(t, userFailed, subjects, "command.failed for the user commands")

	// Again: nothing changes but a fresh poke.
	again := f.revoke(n, "again")
	require.False(t, again.Newly)
	require.Zero(t, again.CertificatesRevoked)
	require.True(t, again.RevokedAt.Equal(rev.RevokedAt))
	require.Empty(t, again.CommandsFailed)
	require.Equal(t, "stolen", again.Reason, "the first reason stands")
	after, err = store.GetNode(ctx, f.db.Pool, store.AllTenants, n)
	require.NoError(t, err)
	require.Equal(t, "stolen", after.RevokeReason)
	require.True(t, after.RevokedAt.Equal(rev.RevokedAt))
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM events WHERE type = $1`, store.EventNodeRevoked).Scan(&events))
	require.Equal(t, 1, events)

	err = f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.RevokeNode(ctx, tx, store.AllTenants, f.db.Now(), "node_missing", "")
		return err
	})
	require.ErrorIs(t, err, store.ErrNotFound)
}

// TestRevokedNodeSessions: a revoked node's certificates read as revoked at
// Hello and renewal, its session gets nothing delivered and shows up in the
// periodic re-read; a revoked certificate alone does too.
func TestRevokedNodeSessions(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n := f.nodeWith(storetest.NodeOpts{SpecGeneration: 1, Spec: `{}`})
	other, fine := f.node(), f.node()
	now := f.db.Now()
	// Only one certificate of node other is revoked.
	f.cert(other, "0b", now.Add(time.Hour), now)
	f.cert(other, "0c", now.Add(time.Hour), time.Time{})
	f.cert(fine, "0d", now.Add(time.Hour), time.Time{})
	sn, _ := f.open(n, "gw", 0)
	so, _ := f.open(other, "gw", 0)
	sf, _ := f.open(fine, "gw", 0)
	q := f.command(n, "queued", "user", now)

	// Node n's certificate is recorded after its revocation (as if a
	// renewal raced the revocation): the node's revocation covers it.
	f.revoke(n, "")
	f.cert(n, "0a", now.Add(time.Hour), time.Time{})
	c, err := store.GetSessionCert(ctx, f.db.Pool, "0a")
	require.NoError(t, err)
	require.NotNil(t, c.RevokedAt)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		c, err := store.LockSessionCert(ctx, tx, "0a")
		require.NotNil(t, c.RevokedAt)
		return err
	}))
	c, err = store.GetSessionCert(ctx, f.db.Pool, "0c")
	require.NoError(t, err)
	require.Nil(t, c.RevokedAt)

	d := f.claim(n, sn, 0, true)
	require.True(t, d.Revoked)
	require.Empty(t, d.Commands)
	require.Nil(t, d.Spec)
	state, deliveries := f.commandState(q)
	require.Equal(t, "failed", state, "the revocation failed it")
	require.Zero(t, deliveries, "nothing is claimed for a revoked node")

	work, err := store.PendingSessionWork(ctx, f.db.Pool, []store.SessionRef{
		{NodeID: n, SessionID: sn, Serial: "0a"},
		{NodeID: other, SessionID: so, Serial: "0b"},
		{NodeID: fine, SessionID: sf, Serial: "0d"},
	})
	require.NoError(t, err)
	byNode := map[string]store.SessionWork{}
	for _, w := range work {
		byNode[w.NodeID] = w
	}
	require.True(t, byNode[n].Revoked, "revoked node")
	require.True(t, byNode[other].Revoked, "revoked session certificate")
	require.NotContains(t, byNode, fine)

	// The same node's session on its other, valid certificate is fine.
	work, err = store.PendingSessionWork(ctx, f.db.Pool, []store.SessionRef{{NodeID: other, SessionID: so, Serial: "0c"}})
	require.NoError(t, err)
	require.Empty(t, work)
	// Unless the certificate renewed on that session is the revoked one.
	work, err = store.PendingSessionWork(ctx, f.db.Pool, []store.SessionRef{{NodeID: other, SessionID: so, Serial: "0c",
		Renewed: "0b"}})
	require.NoError(t, err)
	require.Len(t, work, 1)
	require.True(t, work[0].Revoked, "revoked renewed certificate")
	work, err = store.PendingSessionWork(ctx, f.db.Pool, []store.SessionRef{{NodeID: fine, SessionID: sf, Serial: "0d",
		Renewed: "0d"}})
	require.NoError(t, err)
	require.Empty(t, work)
}

// TestLastNodeCertCreatedAt: the time of a node's newest certificate, zero
// for a node that has none.
func TestLastNodeCertCreatedAt(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n, none := f.node(), f.node()
	now := f.db.Now()
	for i, at := range []time.Time{now.Add(-2 * time.Hour), now.Add(-time.Hour), now.Add(-3 * time.Hour)} {
		storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: n, Serial: fmt.Sprintf("1%d", i), CreatedAt: at})
	}
	at, err := store.LastNodeCertCreatedAt(ctx, f.db.Pool, n)
	require.NoError(t, err)
	require.True(t, at.Equal(now.Add(-time.Hour)), "%s", at)
	at, err = store.LastNodeCertCreatedAt(ctx, f.db.Pool, none)
	require.NoError(t, err)
	require.True(t, at.IsZero(), "%s", at)
}

func TestRecordSpecRefused(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	n := f.node()
	require.NoError(t, store.RecordSpecRefused(ctx, f.db.Pool, f.db.Now(), n, 3, "refused: unsigned"))
	var data []byte
	var tenant *string
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT data, tenant_id FROM events WHERE type = $1 AND subject_id = $2`,
		store.EventNodeSpecRefused, n).Scan(&data, &tenant))
	require.NotNil(t, tenant)
	require.JSONEq(t, `{"nodeId": "`+n+`", "generation": 3, "reason": "refused: unsigned"}`, string(data))
	require.ErrorIs(t, store.RecordSpecRefused(ctx, f.db.Pool, f.db.Now(), "node_missing", 1, "x"), store.ErrNotFound)
}
