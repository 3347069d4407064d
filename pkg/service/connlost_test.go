package service_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"syscall"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/service"
)

// cutServer answers Watch with one event and ListNodes with half a body,
// then drops the connection, as a server that is killed mid-response does.
func cutServer(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case computev1connect.EventServiceWatchProcedure:
			msg, err := proto.Marshal(&computev1.WatchResponse{Event: &computev1.Event{Id: 7}})
			if err != nil {
				panic(err)
			}
			w.Header().Set("Content-Type", "application/connect+proto")
			w.WriteHeader(http.StatusOK)
			var prefix [5]byte
			binary.BigEndian.PutUint32(prefix[1:], uint32(len(msg)))
			_, _ = w.Write(append(prefix[:], msg...))
			_, _ = w.Write(prefix[:2]) // the next envelope, cut short
		case computev1connect.NodeServiceListNodesProcedure:
			w.Header().Set("Content-Type", "application/proto")
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte{0x0a, 0x02})
		}
		http.NewResponseController(w).Flush() //nolint:errcheck // the client sees what was written
		panic(http.ErrAbortHandler)           // drop the connection
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestConnectionLost checks that a connection dropped mid-response, on a
// stream and on a unary call, becomes Unavailable "lost the connection to
// …" with its cause, and that the server's own errors and other failures
// are left as they are.
func TestConnectionLost(t *testing.T) {
	t.Parallel()
	srv := cutServer(t)
	events := computev1connect.NewEventServiceClient(srv.Client(), srv.URL)
	stream, err := events.Watch(t.Context(), connect.NewRequest(&computev1.WatchRequest{}))
	require.NoError(t, err)
	require.True(t, stream.Receive(), "the first event: %v", stream.Err())
	require.Equal(t, int64(7), stream.Msg().GetEvent().GetId())
	require.False(t, stream.Receive())
	raw := stream.Err()
	require.NoError(t, stream.Close())
	require.Equal(t, connect.CodeInternal, connect.CodeOf(raw), "connect-go's own view: %v", raw)
	lost := service.ConnectionLost(raw, "the API server")
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(lost))
	require.Equal(t, "unavailable: lost the connection to the API server: protocol error: incomplete envelope: unexpected EOF",
		lost.Error())
	require.ErrorIs(t, lost, io.ErrUnexpectedEOF)

	nodes := computev1connect.NewNodeServiceClient(srv.Client(), srv.URL)
	_, raw = nodes.ListNodes(t.Context(), connect.NewRequest(&computev1.ListNodesRequest{}))
	require.Error(t, raw)
	lost = service.ConnectionLost(raw, "the API server")
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(lost), "%v", raw)
	require.Equal(t, "unavailable: lost the connection to the API server: read message: unexpected EOF", lost.Error(),
		"connect-go's own view: %v", raw)

	// A write on the dropped connection: connect-go says Canceled with the
	// write's error as the cause.
	for _, cause := range []error{syscall.EPIPE, syscall.ECONNRESET} {
		raw := connect.NewError(connect.CodeCanceled, &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", cause)})
		lost := service.ConnectionLost(raw, "the gateway")
		require.Equal(t, connect.CodeUnavailable, connect.CodeOf(lost), "%v", raw)
		require.Equal(t, "unavailable: lost the connection to the gateway: write tcp: write: "+cause.Error(), lost.Error())
		require.ErrorIs(t, lost, cause)
	}

	// Left as they are: nil, the server's errors (even Internal ones that
	// mention an EOF), other client errors, errors that are not Connect's.
	require.NoError(t, service.ConnectionLost(nil, "x"))
	wire := connect.NewWireError(connect.CodeInternal, io.ErrUnexpectedEOF)
	require.Same(t, wire, service.ConnectionLost(wire, "x"))
	for _, e := range []error{
		connect.NewError(connect.CodeInternal, errors.New("corrupt response")),
		connect.NewError(connect.CodeUnknown, io.EOF),
		connect.NewError(connect.CodeInvalidArgument, io.ErrUnexpectedEOF),
		connect.NewError(connect.CodeCanceled, context.Canceled),
		connect.NewError(connect.CodeCanceled, fmt.Errorf("%w while writing: %w", context.Canceled, syscall.EPIPE)),
		connect.NewError(connect.CodeCanceled, errors.New("canceled by the caller")),
		io.ErrUnexpectedEOF,
	} {
		require.Equal(t, e, service.ConnectionLost(e, "x"), "%v", e)
	}
}
