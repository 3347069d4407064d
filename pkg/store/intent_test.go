package store_test

import (
	"crypto/ed25519"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func newIntentSigner(t *testing.T) (*store.IntentSigner, ed25519.PublicKey) {
	t.Helper()
	key, err := pki.GenerateSigningKey()
	require.NoError(t, err)
	s, err := store.NewIntentSigner(key)
	require.NoError(t, err)
	return s, s.Public()
}

// delivered returns what the gateway sends a new session of nodeID: its
// commands and, when its spec generation is above 0, its DesiredState, built
// as the gateway builds them.
func (f gatewayFixture) delivered(nodeID string) ([]*gatewayv1.Command, *gatewayv1.DesiredState) {
	f.t.Helper()
	sid, _ := f.open(nodeID, "gw", 0)
	d := f.claim(nodeID, sid, 0, true)
	var cmds []*gatewayv1.Command
	for _, c := range d.Commands {
		cmds = append(cmds, store.CommandMessage(c))
	}
	if d.Spec == nil {
		return cmds, nil
	}
	ds, err := store.DesiredStateMessage(d.SpecGeneration, d.Spec, d.SpecSignature)
	require.NoError(f.t, err)
	return cmds, ds
}

// TestSignedCommandsVerifyAsDelivered: a command signed at creation verifies,
// with the daemon's own check, as the gateway delivers it, although jsonb
// rewrote its arguments and Postgres cut its deadline to microseconds; it
// does not verify for another node.
func TestSignedCommandsVerifyAsDelivered(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	signer, root := newIntentSigner(t)
	n, other := f.node(), f.node()
	now := f.db.Now()
	id := ids.New(ids.Command, now)
	args := `{"b": 1,   "a": [1,2], "c": {"z": true, "y": null}}`
	deadline := time.Date(2030, 1, 2, 3, 4, 5, 123456789, time.FixedZone("X", 3600))
	storetest.Command(t, f.db, &storetest.CommandOpts{ID: id, NodeID: n, Kind: store.CommandLogsCollect, Args: args,
		RetrySafe: new(bool), Deadline: deadline, CreatedAt: now})
	require.NoError(t, store.SignCommands(ctx, f.db.Pool, signer, []string{id}))

	cmds, _ := f.delivered(n)
	require.Len(t, cmds, 1)
	c := cmds[0]
	require.NotEqual(t, args, string(c.GetArgsJson()), "jsonb normalised the arguments")
	require.NotEqual(t, deadline.UnixNano(), c.GetDeadline().AsTime().UnixNano(), "Postgres kept microseconds")
	require.NotEmpty(t, c.GetSignature())
	require.Empty(t, daemon.VerifyCommand(root, n, c), "verifies as delivered")
	require.Equal(t, daemon.ErrTextCommandBadSignature, daemon.VerifyCommand(root, other, c), "bound to its node")
	_, otherRoot := newIntentSigner(t)
	require.Equal(t, daemon.ErrTextCommandBadSignature, daemon.VerifyCommand(otherRoot, n, c))

	// Acceptance commands are signed by the function that queues them.
	acc := ids.New(ids.Command, now)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		return store.QueueAcceptanceCommands(ctx, tx, signer, now, now.Add(time.Minute),
			[]store.NewAcceptanceCommand{{ID: acc, NodeID: other}})
	}))
	cmds, _ = f.delivered(other)
	require.Len(t, cmds, 1)
	require.Equal(t, acc, cmds[0].GetCommandId())
	require.Empty(t, daemon.VerifyCommand(root, other, cmds[0]))

	// Without a signer nothing is signed.
	unsigned := ids.New(ids.Command, now)
	third := f.node()
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		return store.QueueAcceptanceCommands(ctx, tx, nil, now, now.Add(time.Minute),
			[]store.NewAcceptanceCommand{{ID: unsigned, NodeID: third}})
	}))
	cmds, _ = f.delivered(third)
	require.Len(t, cmds, 1)
	require.Empty(t, cmds[0].GetSignature())
	require.Equal(t, daemon.ErrTextCommandUnsigned, daemon.VerifyCommand(root, third, cmds[0]))

	require.ErrorContains(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		return store.SignCommands(ctx, tx, signer, []string{"cmd_missing"})
	}), "not found")
}

// TestSignedSpecsVerifyAsDelivered: the spec of an adopted node is signed in
// the adoption's transaction and verifies as delivered; a later change of the
// spec that is not signed again clears the old signature.
func TestSignedSpecsVerifyAsDelivered(t *testing.T) {
	t.Parallel()
	f := newGatewayFixture(t)
	ctx := t.Context()
	signer, root := newIntentSigner(t)
	n := f.node()
	now := f.db.Now()
	spec, err := protojson.Marshal(&gatewayv1.NodeSpec{Labels: map[string]string{"z": "1", "a": "2", "m": "3"},
		Allocations: []*gatewayv1.Allocation{{ReservationId: "res_1", DeviceIndexes: []int32{3, 1}}}})
	require.NoError(t, err)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := store.MarkNodesAccepting(ctx, tx, now, []string{n}); err != nil {
			return err
		}
		adopted, err := store.AdoptNodes(ctx, tx, signer, now, []store.Adoption{{NodeID: n, PoolID: f.poolID,
			Spec: spec, Inventory: []byte(`{}`)}})
		require.Equal(t, []string{n}, adopted)
		return err
	}))
	_, ds := f.delivered(n)
	require.NotNil(t, ds)
	require.EqualValues(t, 1, ds.GetGeneration())
	require.Len(t, ds.GetSpec().GetLabels(), 3)
	require.Empty(t, daemon.VerifySpec(root, n, ds), "verifies as delivered")
	require.Equal(t, daemon.ErrTextSpecBadSignature, daemon.VerifySpec(root, f.node(), ds), "bound to its node")

	// A writer that bumps the spec without signing leaves it unsigned, not
	// with generation 1's signature. Raw SQL: such a writer is what this
	// checks, and no store function is one.
	_, err = f.db.Pool.Exec(ctx, `UPDATE nodes SET spec_generation = 2, spec = '{"labels": {"a": "b"}}' WHERE id = $1`, n)
	require.NoError(t, err)
	_, ds = f.delivered(n)
	require.EqualValues(t, 2, ds.GetGeneration())
	require.Empty(t, ds.GetSignature())
	require.Equal(t, daemon.ErrTextSpecUnsigned, daemon.VerifySpec(root, n, ds))

	// Signing it in the writer's transaction fixes that; a signature-only
	// update is kept.
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		return store.SignNodeSpecs(ctx, tx, signer, []string{n})
	}))
	_, ds = f.delivered(n)
	require.Empty(t, daemon.VerifySpec(root, n, ds))

	// A node adopted without a signer has an unsigned spec.
	u := f.node()
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := store.MarkNodesAccepting(ctx, tx, now, []string{u}); err != nil {
			return err
		}
		_, err := store.AdoptNodes(ctx, tx, nil, now, []store.Adoption{{NodeID: u, PoolID: f.poolID, Spec: spec, Inventory: []byte(`{}`)}})
		return err
	}))
	_, ds = f.delivered(u)
	require.Empty(t, ds.GetSignature())
}

func TestNewIntentSignerChecksTheKey(t *testing.T) {
	t.Parallel()
	_, err := store.NewIntentSigner(ed25519.PrivateKey{1, 2, 3})
	require.ErrorContains(t, err, "Ed25519")
	_, err = store.LoadIntentSigner(t.TempDir())
	require.ErrorContains(t, err, pki.CommandSigningKey)
	var nilSigner *store.IntentSigner
	require.Nil(t, nilSigner.Public())
}

// TestRebuiltSpecsAreSignedInTheirWrite: a spec generation that
// RebuildNodeSpecs makes (placements, ends of reservations, SSH user CA
// rotations) is written with its signature in one UPDATE of the node, the
// signature made from the spec as written (no read back, no second row
// version), and verifies as the gateway delivers it. Not parallel: it
// counts the package's statements.
func TestRebuiltSpecsAreSignedInTheirWrite(t *testing.T) {
	f := newGatewayFixture(t)
	ctx := t.Context()
	signer, root := newIntentSigner(t)
	n := storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: f.poolID, State: store.NodeAdopted, SpecGeneration: 1,
		Spec: `{"labels": {"pool": "p", "zone": "b"}}`}).ID
	_, err := f.db.Pool.Exec(ctx, `INSERT INTO ssh_user_cas (name, public_key, updated_at) VALUES ('break-glass', 'ssh-ed25519 AAAAbg', $1)`,
		f.db.Now())
	require.NoError(t, err)

	stmts := storetest.CountStatements()
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		gens, err := store.RebuildNodeSpecs(ctx, tx, signer, f.db.Now(), []string{n})
		require.Equal(t, map[string]int64{n: 2}, gens)
		return err
	}))
	stmts.Stop()
	var nodeWrites, nodeReads []string
	for _, sql := range callerStatements(stmts.SQL()) {
		switch {
		case strings.HasPrefix(strings.TrimSpace(sql), "UPDATE nodes"):
			nodeWrites = append(nodeWrites, sql)
		case strings.Contains(sql, "spec FROM nodes"):
			nodeReads = append(nodeReads, sql)
		}
	}
	require.Len(t, nodeWrites, 1, "the spec, its generation and its signature in one update:\n%s", strings.Join(nodeWrites, "\n---\n"))
	require.Len(t, nodeReads, 1, "the spec read once, locked, before the rebuild:\n%s", strings.Join(nodeReads, "\n---\n"))

	_, ds := f.delivered(n)
	require.EqualValues(t, 2, ds.GetGeneration())
	require.Equal(t, "break-glass", ds.GetSpec().GetSshUserCas()[0].GetName())
	require.Len(t, ds.GetSpec().GetLabels(), 2, "labels kept")
	require.Empty(t, daemon.VerifySpec(root, n, ds), "verifies as delivered")

	// Without a signer the new generation is unsigned, not generation 1's
	// signature.
	_, err = f.db.Pool.Exec(ctx, `DELETE FROM ssh_user_cas`)
	require.NoError(t, err)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.RebuildNodeSpecs(ctx, tx, nil, f.db.Now(), []string{n})
		return err
	}))
	_, ds = f.delivered(n)
	require.EqualValues(t, 3, ds.GetGeneration())
	require.Equal(t, daemon.ErrTextSpecUnsigned, daemon.VerifySpec(root, n, ds))
}
