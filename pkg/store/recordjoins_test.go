package store_test

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// newJoin returns a join of the token whose secret hashes to hash, its
// node a new one and its join key the SHA-256 of key.
func newJoin(now time.Time, hash []byte, key string) store.Join {
	k := sha256.Sum256([]byte(key))
	node := ids.New(ids.Node, now)
	return store.Join{
		TokenHash: hash,
		Node:      store.NewNode{ID: node, Hostname: "host-" + key, MachineID: "machine-" + key, Variant: "hgx-h100", AgentVersion: "v1"},
		Cert: store.NewNodeCert{Serial: fmt.Sprintf("%x", k[:8]), PublicKeySHA256: k[:], NotBefore: now,
			NotAfter: now.Add(24 * time.Hour)},
	}
}

// TestRecordJoins: one batch of joins of several tokens, recorded in one
// statement on AutoCommit: a token's joins get its remaining uses in batch
// order and the rest are refused as used up; an unknown, revoked or expired
// token refuses its joins and counts nothing; a key that joined already is a
// retry, answered with its node; a key twice in the batch is recorded once.
// The nodes, their certificates, one node.joined event each (ordered by
// node id) and one controllers' poke naming them are written.
func TestRecordJoins(t *testing.T) {
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	tok := func(o storetest.JoinTokenOpts) store.JoinToken {
		o.PoolID = f.pool.ID
		return storetest.JoinToken(t, f.db, &o)
	}
	two := tok(storetest.JoinTokenOpts{MaxUses: 5, Uses: 3})
	many := tok(storetest.JoinTokenOpts{MaxUses: 100})
	revoked := tok(storetest.JoinTokenOpts{MaxUses: 5, RevokedAt: now.Add(-time.Minute)})
	expired := tok(storetest.JoinTokenOpts{MaxUses: 5, ExpiresAt: now.Add(-time.Second), CreatedAt: now.Add(-time.Hour)})

	// A key that joined before the batch.
	before := newJoin(now, many.Hash, "joined-before")
	out, err := store.RecordJoins(ctx, f.db.AutoCommit(), now, []store.Join{before})
	require.NoError(t, err)
	require.NoError(t, out[0].Err)
	require.EqualValues(t, 1, out[0].Token.Uses)

	joins := []store.Join{
		newJoin(now, two.Hash, "a"),       // 0: use 4 of 5
		newJoin(now, many.Hash, "b"),      // 1: use 2 of 100
		newJoin(now, two.Hash, "c"),       // 2: use 5 of 5
		newJoin(now, two.Hash, "d"),       // 3: used up
		newJoin(now, []byte("nope"), "e"), // 4: unknown
		newJoin(now, revoked.Hash, "f"),   // 5: revoked
		newJoin(now, expired.Hash, "g"),   // 6: expired
		newJoin(now, many.Hash, "joined-before"),
		newJoin(now, many.Hash, "b"), // 8: the key of 1
		newJoin(now, many.Hash, "h"), // 9: use 3 of 100
	}
	stmts := storetest.CountStatements()
	out, err = store.RecordJoins(ctx, f.db.AutoCommit(), now, joins)
	stmts.Stop()
	require.NoError(t, err)
	var sql []string
	for _, s := range stmts.SQL() {
		if !strings.Contains(s, "pg_notify") {
			sql = append(sql, s)
		}
	}
	require.Len(t, sql, 1, strings.Join(sql, "\n---\n"))

	require.Len(t, out, len(joins))
	created := []int{0, 1, 2, 9}
	for _, i := range created {
		require.NoError(t, out[i].Err, i)
		require.Nil(t, out[i].Rejoin, i)
	}
	require.Equal(t, two.ID, out[0].Token.ID)
	require.EqualValues(t, 4, out[0].Token.Uses)
	require.EqualValues(t, 5, out[2].Token.Uses)
	require.Equal(t, many.ID, out[1].Token.ID)
	require.EqualValues(t, 2, out[1].Token.Uses)
	require.EqualValues(t, 3, out[9].Token.Uses)
	require.ErrorIs(t, out[3].Err, store.ErrJoinTokenUsedUp)
	require.EqualError(t, out[3].Err, "join token is used up (5 of 5 uses)")
	require.ErrorIs(t, out[4].Err, store.ErrJoinTokenUnknown)
	require.ErrorIs(t, out[5].Err, store.ErrJoinTokenRevoked)
	require.ErrorIs(t, out[6].Err, store.ErrJoinTokenExpired)
	require.Equal(t, expired.ID, out[6].Token.ID)
	require.NoError(t, out[7].Err)
	require.Equal(t, &store.JoinedKey{NodeID: before.Node.ID, PoolID: f.pool.ID}, out[7].Rejoin)
	require.ErrorIs(t, out[8].Err, store.ErrSameKeyInBatch)

	for tokID, uses := range map[string]int32{two.ID: 5, many.ID: 3, revoked.ID: 0, expired.ID: 0} {
		jt, err := store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, tokID)
		require.NoError(t, err)
		require.Equal(t, uses, jt.Uses, tokID)
	}
	var nodeIDs []string
	for _, i := range created {
		j := joins[i]
		nodeIDs = append(nodeIDs, j.Node.ID)
		n, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, j.Node.ID)
		require.NoError(t, err)
		require.Equal(t, store.NodeJoining, n.ProvisionState)
		require.Equal(t, f.pool.ID, n.PoolID)
		require.Equal(t, j.Node.Hostname, n.Hostname)
		require.Equal(t, j.Node.MachineID, n.MachineID)
		require.Equal(t, j.Node.Variant, n.Variant)
		require.Equal(t, j.Node.AgentVersion, n.AgentVersion)
		require.True(t, n.CreatedAt.Equal(now))
		var (
			tokenID           string
			serial            string
			key               []byte
			notBefore, notAft time.Time
		)
		require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT n.join_token_id, c.serial, c.public_key_sha256, c.not_before, c.not_after
			FROM nodes n JOIN node_certs c ON c.node_id = n.id AND c.public_key_sha256 = n.join_key_sha256 WHERE n.id = $1`,
			j.Node.ID).Scan(&tokenID, &serial, &key, &notBefore, &notAft))
		require.Equal(t, out[i].Token.ID, tokenID)
		require.Equal(t, j.Cert.Serial, serial)
		require.Equal(t, j.Cert.PublicKeySHA256, key)
		require.True(t, notBefore.Equal(j.Cert.NotBefore) && notAft.Equal(j.Cert.NotAfter))
	}
	var nodes int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM nodes`).Scan(&nodes))
	require.Equal(t, len(created)+1, nodes, "nothing else was written")

	slices.Sort(nodeIDs)
	rows, err := f.db.Pool.Query(ctx, `SELECT tenant_id, subject_id, data::text, created_at FROM events
		WHERE type = 'node.joined' AND subject_id <> $1 ORDER BY id`, before.Node.ID)
	require.NoError(t, err)
	var subjects []string
	for rows.Next() {
		var (
			tenant, subject, data string
			at                    time.Time
		)
		require.NoError(t, rows.Scan(&tenant, &subject, &data, &at))
		require.Equal(t, f.tenant.ID, tenant)
		require.JSONEq(t, `{"nodeId": "`+subject+`"}`, data)
		require.True(t, at.Equal(now))
		subjects = append(subjects, subject)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, nodeIDs, subjects, "one event per node, ordered by node id")

	var payloads [][]byte
	rows, err = f.db.Pool.Query(ctx, `SELECT payload FROM outbox WHERE subject = $1 ORDER BY id`, store.SubjectPokeControllers)
	require.NoError(t, err)
	for rows.Next() {
		var p []byte
		require.NoError(t, rows.Scan(&p))
		payloads = append(payloads, p)
	}
	require.NoError(t, rows.Err())
	require.Len(t, payloads, 2, "one poke per batch that created nodes")
	var poke store.Poke
	require.NoError(t, json.Unmarshal(payloads[1], &poke))
	require.Equal(t, nodeIDs, poke.NodeIDs)

	// A batch that creates nothing writes nothing.
	out, err = store.RecordJoins(ctx, f.db.AutoCommit(), now, []store.Join{newJoin(now, two.Hash, "i"), newJoin(now, []byte("nope"), "j")})
	require.NoError(t, err)
	require.ErrorIs(t, out[0].Err, store.ErrJoinTokenUsedUp)
	require.ErrorIs(t, out[1].Err, store.ErrJoinTokenUnknown)
	var pokes int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&pokes))
	require.Equal(t, 2, pokes)
}

// TestRecordJoinsConcurrent: concurrent batches of one token, each its own
// statement, never take more than its max_uses in all: the token's lock
// orders them and each reads the uses the others counted.
func TestRecordJoinsConcurrent(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	now := f.db.Now()
	const batches, perBatch, maxUses = 16, 5, 42
	jt := storetest.JoinToken(t, f.db, &storetest.JoinTokenOpts{PoolID: f.pool.ID, MaxUses: maxUses})
	other := storetest.JoinToken(t, f.db, &storetest.JoinTokenOpts{PoolID: f.pool.ID, MaxUses: 1000})
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		granted []int32
		refused int
		errs    []error
	)
	for b := range batches {
		wg.Go(func() {
			joins := make([]store.Join, 0, 2*perBatch)
			for i := range perBatch {
				// Two tokens in every batch, in either order: their locks are
				// taken in hash order, so no two batches deadlock.
				first, second := jt.Hash, other.Hash
				if b%2 == 1 {
					first, second = second, first
				}
				joins = append(joins, newJoin(now, first, fmt.Sprintf("%d-%d-1", b, i)), newJoin(now, second, fmt.Sprintf("%d-%d-2", b, i)))
			}
			out, err := store.RecordJoins(t.Context(), f.db.AutoCommit(), now, joins)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
			for _, o := range out {
				switch {
				case o.Token.ID != jt.ID:
				case o.Err == nil:
					granted = append(granted, o.Token.Uses)
				case errors.Is(o.Err, store.ErrJoinTokenUsedUp):
					refused++
				default:
					errs = append(errs, o.Err)
				}
			}
		})
	}
	wg.Wait()
	require.Empty(t, errs, "no deadlock, no other refusal")
	slices.Sort(granted)
	want := make([]int32, maxUses)
	for i := range want {
		want[i] = int32(i + 1)
	}
	require.Equal(t, want, granted, "each use granted once")
	require.Equal(t, batches*perBatch-maxUses, refused)
	got, err := store.GetJoinToken(t.Context(), f.db.Pool, store.AllTenants, jt.ID)
	require.NoError(t, err)
	require.EqualValues(t, maxUses, got.Uses)
}
