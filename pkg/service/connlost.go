package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"

	"connectrpc.com/connect"
)

// ConnectionLost returns err, an error of a Connect client's call to peer
// (e.g. "the API server"), as Unavailable "lost the connection to <peer>:
// <cause>" when it says that the connection dropped in the middle of a
// response: the server (or a proxy before it) was killed or restarted.
// connect-go reports that as Internal "protocol error: incomplete
// envelope: unexpected EOF" (or "promised N bytes in enveloped message") on
// a stream and as Unknown "read message: unexpected EOF" on a unary call,
// which reads as a bug of the server rather than the transient failure it
// is, and a write on the dropped connection as Canceled "…: broken pipe"
// (or "connection reset by peer"), which reads as the caller's own
// cancellation: a caller that retries Unavailable retries it. Any other error, nil,
// and every error the server itself sent (connect.IsWireError) are returned
// unchanged; the result still matches the cause (errors.Is
// io.ErrUnexpectedEOF).
func ConnectionLost(err error, peer string) error {
	var cerr *connect.Error
	if !errors.As(err, &cerr) || connect.IsWireError(err) {
		return err
	}
	switch cerr.Code() {
	case connect.CodeInternal, connect.CodeUnknown:
		if !errors.Is(err, io.ErrUnexpectedEOF) && !reset(err) && !strings.Contains(cerr.Message(), "incomplete envelope") {
			return err
		}
	case connect.CodeCanceled:
		// A write on a connection the peer dropped (a request message or
		// a stream's next one), which connect-go reports as Canceled; the
		// caller's own cancellation stays Canceled.
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || !reset(err) {
			return err
		}
	default:
		return err
	}
	cause := cerr.Unwrap()
	if cause == nil {
		cause = errors.New(cerr.Message())
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("lost the connection to %s: %w", peer, cause))
}

// reset reports whether err says the peer closed or reset the connection
// (ECONNRESET, EPIPE).
func reset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
