package store_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

// closedURL is a database URL on a loopback port where nothing listens:
// connecting fails at once (connection refused).
const closedURL = "postgres://bc@127.0.0.1:1/bc?connect_timeout=5&sslmode=disable"

// TestIsUnavailable checks which errors count as a failure to reach the
// database: the errors of a real failed connect and of a pool's failed
// acquire, network errors, and the server's shutdown/startup refusals; not
// the caller's own context ending, answers such as constraint violations,
// or other errors.
func TestIsUnavailable(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	_, connectErr := pgconn.Connect(ctx, closedURL)
	require.Error(t, connectErr)
	var ce *pgconn.ConnectError
	require.ErrorAs(t, connectErr, &ce)
	pool, err := pgxpool.New(ctx, closedURL)
	require.NoError(t, err) // pgxpool connects lazily
	defer pool.Close()
	_, acquireErr := pool.Exec(ctx, "SELECT 1")
	require.Error(t, acquireErr)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()

	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"connect refused", connectErr, true},
		{"pool acquire", fmt.Errorf("list nodes: %w", acquireErr), true},
		{"connect timed out", &pgconn.ConnectError{Config: ce.Config}, true},
		{"no such host", &net.DNSError{Err: "no such host", Name: "db", IsNotFound: true}, true},
		{"connection reset", fmt.Errorf("scan: %w", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}), true},
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true},
		{"starting up", &pgconn.PgError{Code: "57P03"}, true},
		{"connection exception", &pgconn.PgError{Code: "08006"}, true},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false},
		{"deadline", fmt.Errorf("q: %w", context.DeadlineExceeded), false},
		{"canceled", cancelled.Err(), false},
		{"not found", store.ErrNotFound, false},
		{"other", errors.New("boom"), false},
		{"nil", nil, false},
	} {
		require.Equal(t, c.want, store.IsUnavailable(c.err), "%s: %#v", c.name, c.err)
	}
}
