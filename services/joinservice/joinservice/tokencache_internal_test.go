package joinservice

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestTokenChecksReadOnce: the checks of a token that arrive while its read
// is in flight wait for that read: 32 concurrent checks of a token not yet
// remembered send one statement (32 before), and each gets the token. The
// read is held in flight by a lock on join_tokens. Not parallel: the
// counter sees every statement of the process.
func TestTokenChecksReadOnce(t *testing.T) {
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	jt := storetest.JoinToken(t, db, &storetest.JoinTokenOpts{MaxUses: 100})

	lock, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(ctx) }()
	_, err = lock.Exec(ctx, `LOCK TABLE join_tokens IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	var c tokenChecks
	stmts := storetest.CountStatements()
	const checks = 32
	got := make([]store.JoinToken, checks)
	errs := make([]error, checks)
	var wg sync.WaitGroup
	check := func(i int) { got[i], errs[i] = c.check(ctx, db, jt.Hash, now) }
	wg.Go(func() { check(0) })
	// The first check's read is in flight (waiting for the lock) before the
	// others start.
	require.Eventually(t, func() bool {
		var waiting int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%FROM join_tokens j WHERE j.hash%'`).
			Scan(&waiting))
		return waiting == 1
	}, 10*time.Second, time.Millisecond)
	for i := 1; i < checks; i++ {
		wg.Go(func() { check(i) })
	}
	require.NoError(t, lock.Rollback(ctx))
	wg.Wait()
	stmts.Stop()
	for i := range checks {
		require.NoError(t, errs[i], i)
		require.Equal(t, jt.ID, got[i].ID, i)
	}
	var reads []string
	for _, s := range stmts.SQL() {
		if strings.Contains(s, "FROM join_tokens j WHERE j.hash = $1") {
			reads = append(reads, s)
		}
	}
	require.Equal(t, 1, len(reads), "reads of the token")
}
