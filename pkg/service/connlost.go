package service

import (
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
// is: a caller that retries Unavailable retries it. Any other error, nil,
// and every error the server itself sent (connect.IsWireError) are returned
// unchanged; the result still matches the cause (errors.Is
// io.ErrUnexpectedEOF).
func ConnectionLost(err error, peer string) error {
	var cerr *connect.Error
	if !errors.As(err, &cerr) || connect.IsWireError(err) {
		return err
	}
	if code := cerr.Code(); code != connect.CodeInternal && code != connect.CodeUnknown {
		return err
	}
	if !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, syscall.ECONNRESET) &&
		!strings.Contains(cerr.Message(), "incomplete envelope") {
		return err
	}
	cause := cerr.Unwrap()
	if cause == nil {
		cause = errors.New(cerr.Message())
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("lost the connection to %s: %w", peer, cause))
}
