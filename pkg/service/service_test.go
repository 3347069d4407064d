package service_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/syncbuf"
)

// failing answers ListNodes (unary) with err, and Watch (a server stream)
// with one message and then err.
type failing struct {
	computev1connect.UnimplementedNodeServiceHandler
	computev1connect.UnimplementedEventServiceHandler
	err error
}

func (f *failing) ListNodes(context.Context, *connect.Request[computev1.ListNodesRequest]) (*connect.Response[computev1.ListNodesResponse], error) {
	return nil, f.err
}

func (f *failing) Watch(_ context.Context, _ *connect.Request[computev1.WatchRequest], s *connect.ServerStream[computev1.WatchResponse]) error {
	if err := s.Send(&computev1.WatchResponse{Event: &computev1.Event{Id: 1}}); err != nil {
		return err
	}
	return f.err
}

// syncBuffer is syncbuf.Buffer: safe for concurrent writers and readers.
type syncBuffer = syncbuf.Buffer

// TestMaskInternal checks that HandlerOptions gives clients of unary and
// streaming calls "internal error" in place of an internal error's text,
// Unavailable for a failure to reach the database, and other codes as they
// are, and logs the real error of what it masked.
func TestMaskInternal(t *testing.T) {
	t.Parallel()
	_, connectErr := pgconn.Connect(t.Context(), "postgres://bc@127.0.0.1:1/bc?sslmode=disable")
	require.Error(t, connectErr)
	for _, c := range []struct {
		name   string
		err    error
		code   connect.Code
		msg    string
		logged string
	}{
		{"plain", errors.New(`ERROR: relation "secret_table" does not exist`), connect.CodeInternal, service.MsgInternal,
			"secret_table"},
		{"internal", connect.NewError(connect.CodeInternal, errors.New("scan: secret_column")), connect.CodeInternal,
			service.MsgInternal, "secret_column"},
		{"database down", connect.NewError(connect.CodeInternal, fmt.Errorf("authenticate: %w", connectErr)),
			connect.CodeUnavailable, service.MsgUnavailable, "127.0.0.1"},
		{"not found", connect.NewError(connect.CodeNotFound, errors.New("node n1 not found")), connect.CodeNotFound,
			"node n1 not found", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var logs syncBuffer
			opts := service.HandlerOptions(slog.New(slog.NewTextHandler(&logs, nil)))
			h := &failing{err: c.err}
			mux := http.NewServeMux()
			mux.Handle(computev1connect.NewNodeServiceHandler(h, opts...))
			mux.Handle(computev1connect.NewEventServiceHandler(h, opts...))
			ts := httptest.NewServer(mux)
			defer ts.Close()

			check := func(err error) {
				t.Helper()
				require.Equal(t, c.code, connect.CodeOf(err), "%v", err)
				var cerr *connect.Error
				require.ErrorAs(t, err, &cerr)
				require.Equal(t, c.msg, cerr.Message())
			}
			_, err := computev1connect.NewNodeServiceClient(http.DefaultClient, ts.URL).
				ListNodes(t.Context(), connect.NewRequest(&computev1.ListNodesRequest{}))
			check(err)
			stream, err := computev1connect.NewEventServiceClient(http.DefaultClient, ts.URL).
				Watch(t.Context(), connect.NewRequest(&computev1.WatchRequest{}))
			require.NoError(t, err)
			require.True(t, stream.Receive(), "the message before the error: %v", stream.Err())
			require.False(t, stream.Receive())
			check(stream.Err())
			require.NoError(t, stream.Close())
			ts.Close()
			if c.logged != "" {
				require.Contains(t, logs.String(), c.logged, "the real error is logged")
				require.Contains(t, logs.String(), "/bc.compute.v1.EventService/Watch")
			} else {
				require.Empty(t, logs.String())
			}
		})
	}
}

// TestPublicError checks PublicError on its own: nil and non-internal
// errors pass, internal ones are replaced.
func TestPublicError(t *testing.T) {
	t.Parallel()
	got, masked := service.PublicError(nil)
	require.NoError(t, got)
	require.False(t, masked)
	in := connect.NewError(connect.CodeUnauthenticated, errors.New("api token was revoked"))
	got, masked = service.PublicError(in)
	require.Same(t, in, got)
	require.False(t, masked)
	got, masked = service.PublicError(fmt.Errorf("x: %w", &pgconn.PgError{Code: "57P03"}))
	require.True(t, masked)
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(got))
}
