package storetest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

// TestStatementsLeaveOutTheOutboxNotifier: the notifier's NOTIFY, sent by a
// goroutine of its own after some earlier commit, is never counted, while
// every other statement is, the inline NOTIFY of a transaction among them.
func TestStatementsLeaveOutTheOutboxNotifier(t *testing.T) {
	s := &Statements{}
	s.Reset()
	ctx := context.Background()
	for _, sql := range []string{"begin", store.OutboxNotifySQL, `SELECT pg_notify($1, '')`, "commit"} {
		s.TraceQueryStart(ctx, nil, pgx.TraceQueryStartData{SQL: sql})
	}
	s.TraceBatchQuery(ctx, nil, pgx.TraceBatchQueryData{SQL: store.OutboxNotifySQL})
	want := []string{"begin", `SELECT pg_notify($1, '')`, "commit"}
	require.Equal(t, want, s.SQL())
}
