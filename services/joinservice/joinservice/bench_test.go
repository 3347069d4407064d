package joinservice_test

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

// BenchmarkJoinStatements joins 64 machines with one token through the whole
// Connect path, by 1 and by 8 concurrent callers (joins of a batch share its
// transaction), and reports the SQL statements (BEGIN and COMMIT counted)
// and nanoseconds per join. BENCH_SQL=1 prints the statements of the last
// round.
func BenchmarkJoinStatements(b *testing.B) {
	const joins = 64
	for _, callers := range []int{1, 8} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			f := setupWith(b, func(c *joinservice.Config) { c.JoinBurst, c.JoinRate = 1<<20, 1<<20 })
			stmts := storetest.CountStatements()
			var total int
			for b.Loop() {
				b.StopTimer()
				_, secret := f.token(b, joins, f.db.Now().Add(64*time.Hour))
				reqs := make([]*joinv1.JoinRequest, joins)
				for i := range reqs {
					reqs[i] = f.request(b, secret, &joinv1.Claims{Hostname: fmt.Sprintf("m%d", i)})
				}
				stmts.Reset()
				b.StartTimer()
				var wg sync.WaitGroup
				next := make(chan *joinv1.JoinRequest, joins)
				for _, r := range reqs {
					next <- r
				}
				close(next)
				for range callers {
					wg.Go(func() {
						for r := range next {
							_, err := f.client.Join(b.Context(), connect.NewRequest(r))
							require.NoError(b, err)
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				stmts.Stop()
				total += stmts.Count()
				b.StartTimer()
			}
			b.ReportMetric(float64(total)/float64(joins*b.N), "stmts/join")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(joins*b.N), "ns/join")
			if os.Getenv("BENCH_SQL") != "" {
				for _, s := range stmts.SQL() {
					b.Log("SQL: " + strings.Join(strings.Fields(s), " "))
				}
			}
		})
	}
}

// TestJoinStatements: a join alone costs the token's check, then one
// statement with no transaction around it that locks the token, reads the
// keys that joined, and writes the use, the node, its certificate, its
// node.joined event and the controllers' poke (store.RecordJoins), with the
// outbox's NOTIFY after it: 3 statements (7 when the batch was a
// transaction of four). Not parallel: the counter sees every statement of the
// process.
func TestJoinStatements(t *testing.T) {
	f := setupWith(t, nil)
	_, secret := f.token(t, 5, f.db.Now().Add(time.Hour))
	req := f.request(t, secret, &joinv1.Claims{Hostname: "gpu-01"})
	stmts := storetest.CountStatements()
	res, err := f.client.Join(t.Context(), connect.NewRequest(req))
	require.NoError(t, err)
	stmts.Stop()
	require.LessOrEqual(t, stmts.Count(), 3, strings.Join(stmts.SQL(), "\n---\n"))
	require.Equal(t, []string{res.Msg.NodeId}, f.pokedNodes(t))
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'node.joined' AND tenant_id = '`+f.tenantID+
		`' AND subject_id = '`+res.Msg.NodeId+`' AND data = '{"nodeId": "`+res.Msg.NodeId+`"}'`))

	// The next machine of the token, within a second: the token's check
	// before signing is remembered, and only the transaction reads it.
	req = f.request(t, secret, &joinv1.Claims{Hostname: "gpu-02"})
	stmts.Reset()
	_, err = f.client.Join(t.Context(), connect.NewRequest(req))
	require.NoError(t, err)
	stmts.Stop()
	require.LessOrEqual(t, stmts.Count(), 2, strings.Join(stmts.SQL(), "\n---\n"))
}

// TestJoinRevokedSinceChecked: a token revoked after a join found it usable
// (so that the check before signing remembers it) is refused all the same,
// by the transaction's lock of the token, and the refused join consumes
// nothing.
func TestJoinRevokedSinceChecked(t *testing.T) {
	t.Parallel()
	f := setup(t)
	tokenID, secret := f.token(t, 5, f.db.Now().Add(time.Hour))
	_, err := f.client.Join(t.Context(), connect.NewRequest(f.request(t, secret, &joinv1.Claims{Hostname: "gpu-01"})))
	require.NoError(t, err)
	_, err = store.RevokeJoinToken(t.Context(), f.db.Pool, store.AllTenants, tokenID, f.db.Now())
	require.NoError(t, err)
	_, err = f.client.Join(t.Context(), connect.NewRequest(f.request(t, secret, &joinv1.Claims{Hostname: "gpu-02"})))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", err)
	require.ErrorContains(t, err, "join token was revoked")
	jt, err := store.GetJoinToken(t.Context(), f.db.Pool, store.AllTenants, tokenID)
	require.NoError(t, err)
	require.EqualValues(t, 1, jt.Uses)
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM nodes`))
}
