package controllers_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// BenchmarkAcceptanceStatements reports the SQL statements (BEGIN and
// COMMIT counted) and nanoseconds of reconciler passes per node from
// joining to adopted, for 240 nodes that arrive `per` at a time (a pass to
// start them, a pass to adopt them once their commands succeeded: at 100
// joins/s a poke finds a few nodes, not a thousand), unsigned and with
// signed intent. BENCH_SQL=1 prints the statements of the last group's two passes.
func BenchmarkAcceptanceStatements(b *testing.B) {
	const nodes = 240
	_, key, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(b, err)
	for _, signed := range []bool{false, true} {
		for _, per := range []int{1, 4, 240} {
			b.Run(fmt.Sprintf("signed=%v/per=%d", signed, per), func(b *testing.B) {
				wall := clock.New()
				stmts := storetest.CountStatements()
				var took, total int64
				var last []string
				for b.Loop() {
					f := setup(b)
					if signed {
						f.acc.Intent, err = store.NewIntentSigner(key)
						require.NoError(b, err)
					}
					for range nodes / per {
						group := f.addNodes(b, h100Pool, fakehw.VariantHGXH100, per)
						stmts.Reset()
						began := wall.Now()
						require.Equal(b, controllers.PassResult{Started: per}, f.reconcile(b))
						took += int64(clock.Since(wall, began))
						stmts.Stop()
						total += int64(stmts.Count())
						last = stmts.SQL()
						f.succeed(b, fakehw.VariantHGXH100, group...)
						stmts.Reset()
						began = wall.Now()
						require.Equal(b, controllers.PassResult{Adopted: per}, f.reconcile(b))
						took += int64(clock.Since(wall, began))
						stmts.Stop()
						total += int64(stmts.Count())
						last = append(last, stmts.SQL()...)
					}
				}
				b.ReportMetric(float64(total)/float64(nodes*b.N), "stmts/node")
				b.ReportMetric(float64(took)/float64(nodes*b.N), "pass-ns/node")
				if os.Getenv("BENCH_SQL") != "" {
					for _, s := range last {
						b.Log("SQL: " + strings.Join(strings.Fields(s), " "))
					}
				}
			})
		}
	}
}

// TestAcceptanceStatements: with signed intent, the pass that starts one
// node's acceptance costs one read that finds it joining and no acceptance
// due (store.AnyAcceptanceWork) and its transaction of 4 statements (BEGIN,
// the claim, one statement writing the signed command, the move to
// accepting and the gateway's poke, COMMIT); the pass that adopts it the
// read that finds none joining and it due and a transaction of 8: BEGIN,
// the claim, the checks, the SSH user CAs, one statement adopting it with
// its signed spec, its node.adopted event and the scheduler's poke, its
// devices, the gateway's poke, COMMIT. The outbox's NOTIFYs, sent after
// the commits by a goroutine of their own, are not counted. Not parallel:
// the counter sees every statement of the process.
func TestAcceptanceStatements(t *testing.T) {
	f := setup(t)
	_, key, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	f.acc.Intent, err = store.NewIntentSigner(key)
	require.NoError(t, err)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)
	stmts := storetest.CountStatements()
	counted := func() (int, string) {
		var sql []string
		for _, s := range stmts.SQL() {
			if !strings.Contains(s, "pg_notify") {
				sql = append(sql, s)
			}
		}
		return len(sql), strings.Join(sql, "\n---\n")
	}
	require.Equal(t, controllers.PassResult{Started: 1}, f.reconcile(t))
	stmts.Stop()
	got, sql := counted()
	require.LessOrEqual(t, got, 5, sql)
	f.succeed(t, fakehw.VariantHGXH100, n...)
	stmts.Reset()
	require.Equal(t, controllers.PassResult{Adopted: 1}, f.reconcile(t))
	stmts.Stop()
	got, sql = counted()
	require.LessOrEqual(t, got, 9, sql)
	require.Equal(t, store.NodeAdopted, f.state(n[0]))
}
