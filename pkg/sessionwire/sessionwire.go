// Package sessionwire is the framed session transport: a node's Session
// stream (bc.gateway.v1.GatewayService/Session) carried straight over its
// mutual-TLS connection, one session per connection, without HTTP/2.
//
// The daemon asks for it by ALPN (ALPN, "bc-session/1") on the gateway's
// Session port, where the gateway also serves Connect over HTTP/2 ("h2"):
// a gateway that does not know the protocol refuses the handshake with the
// no_application_protocol alert (RFC 7301 §3.2), which IsUnsupported
// recognises, and the daemon falls back to Connect. Tunnels always go over
// Connect.
//
// The messages and their order are those of the Connect stream; only the
// framing differs. Each message is a Connect envelope (the Connect
// protocol's streaming framing, connectrpc.com/docs/protocol): one flags
// byte, the payload's length as a 4-byte big-endian integer, then the
// payload, the binary protobuf encoding of the message, never compressed.
// The daemon ends its direction with TLS close_notify (tls.Conn.CloseWrite);
// the gateway ends the stream with one end-of-stream envelope (flags 0x02)
// whose payload is Connect's end-of-stream JSON, {} or {"error": {"code":
// "aborted", "message": "…"}}, and closes the connection.
//
// Why: on HTTP/2, net/http hands every frame between a connection's reader
// goroutine, the stream's handler and its writer, and keeps per-connection
// and per-stream buffers, for each of thousands of idle sessions. Here a
// heartbeat is one TLS record read by the session's own goroutine and one
// written back (docs/architecture.md, "Sessions").
package sessionwire

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
)

// ALPN is the TLS application protocol (RFC 7301) of the framed session
// transport.
const ALPN = "bc-session/1"

// Envelope flags (Connect protocol, streaming).
const (
	flagEndStream = 0x02
	// headerLen is an envelope's prefix: flags, then the length.
	headerLen = 5
)

// ErrTooLarge is wrapped by the error of a read whose envelope is larger
// than the reader's limit; it is ResourceExhausted.
var ErrTooLarge = errors.New("message larger than the limit")

// bufs holds write and read buffers, so that an idle session holds none.
var bufs = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// WriteMessage writes m as one envelope to w in one Write: on a tls.Conn, a
// message of up to 16 KiB is one TLS record.
func WriteMessage(w io.Writer, m proto.Message) error {
	bp := bufs.Get().(*[]byte)
	defer bufs.Put(bp)
	b, err := proto.MarshalOptions{}.MarshalAppend(append((*bp)[:0], 0, 0, 0, 0, 0), m)
	if err != nil {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("marshal %s: %w", m.ProtoReflect().Descriptor().FullName(), err))
	}
	binary.BigEndian.PutUint32(b[1:headerLen], uint32(len(b)-headerLen))
	*bp = b[:0]
	_, err = w.Write(b)
	return err
}

// endStream is Connect's end-of-stream message.
type endStream struct {
	Error *wireError `json:"error,omitempty"`
}

type wireError struct {
	Code    string `json:"code"`
	Message string `json:"message,omitempty"`
}

// WriteEnd writes the end-of-stream envelope carrying err to w: a Connect
// error keeps its code and message, another error is Unknown, and nil ends
// the stream without error.
func WriteEnd(w io.Writer, err error) error {
	var end endStream
	if err != nil {
		cerr := new(connect.Error)
		if !errors.As(err, &cerr) {
			cerr = connect.NewError(connect.CodeUnknown, err)
		}
		end.Error = &wireError{Code: cerr.Code().String(), Message: cerr.Message()}
	}
	payload, jerr := json.Marshal(end)
	if jerr != nil {
		return jerr
	}
	b := make([]byte, headerLen, headerLen+len(payload))
	b[0] = flagEndStream
	binary.BigEndian.PutUint32(b[1:], uint32(len(payload)))
	_, werr := w.Write(append(b, payload...))
	return werr
}

// ErrEnd is what ReadMessage returns for an end-of-stream envelope without
// error: the gateway ended the stream normally.
var ErrEnd = errors.New("end of stream")

// ReadMessage reads the next envelope from r into m, refusing one larger
// than maxBytes. It returns:
//   - io.EOF when r ended between envelopes (the daemon closed its
//     direction; from the gateway, whose streams end with an envelope, a
//     lost connection);
//   - ErrEnd for an end-of-stream envelope without error;
//   - the *connect.Error an end-of-stream envelope carries;
//   - a ResourceExhausted *connect.Error wrapping ErrTooLarge;
//   - an InvalidArgument *connect.Error for a payload that is not m, or an
//     envelope with unknown flags;
//   - io.ErrUnexpectedEOF when r ended inside an envelope, or r's error.
func ReadMessage(r io.Reader, m proto.Message, maxBytes int) error {
	// The error paths are calls of their own, so that this frame, on the
	// stack of every message a gateway reads, stays small.
	var h [headerLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(h[1:])
	if int64(n) > int64(maxBytes) {
		return errTooLarge(n, maxBytes)
	}
	bp := bufs.Get().(*[]byte)
	b := *bp
	if cap(b) < int(n) {
		b = make([]byte, n)
	}
	b = b[:n]
	if _, err := io.ReadFull(r, b); err != nil {
		bufs.Put(bp)
		if errors.Is(err, io.EOF) {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	var err error
	switch h[0] {
	case 0:
		if uerr := proto.Unmarshal(b, m); uerr != nil {
			err = errUnmarshal(m, uerr)
		}
	case flagEndStream:
		err = endError(b)
	default:
		err = errFlags(h[0])
	}
	if cap(b) <= 64<<10 {
		*bp = b[:0]
	}
	bufs.Put(bp)
	return err
}

func errTooLarge(n uint32, maxBytes int) error {
	return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, n, maxBytes))
}

func errUnmarshal(m proto.Message, err error) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unmarshal %s: %w", m.ProtoReflect().Descriptor().FullName(), err))
}

func errFlags(flags byte) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("envelope flags %#x are not a message's (0) nor an end of stream's (0x02)", flags))
}

// endError is the error an end-of-stream payload carries: ErrEnd for none.
func endError(payload []byte) error {
	var end endStream
	if err := json.Unmarshal(payload, &end); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("end of stream is not Connect's end-of-stream JSON: %w", err))
	}
	if end.Error == nil {
		return ErrEnd
	}
	var code connect.Code
	if err := code.UnmarshalText([]byte(end.Error.Code)); err != nil {
		code = connect.CodeUnknown
	}
	return connect.NewWireError(code, errors.New(end.Error.Message))
}
