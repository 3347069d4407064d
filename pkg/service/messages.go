package service

import (
	"compress/gzip"
	"fmt"
	"io"

	"connectrpc.com/connect"
)

// MaxMessageBytes is the most bytes one message that a Connect handler of a
// service reads may have, decompressed: 1 MiB, for every message of every
// unary call and stream of the API, JoinService and the gateway (the
// gateway's Session included; tunnels read at most one frame, see
// pkg/tunnel MaxMessageBytes). The largest legitimate messages are far
// below it: a Hello's journal of 256 entries (pkg/daemon HelloJournalMax),
// a logs.collect result of 1000 lines.
const MaxMessageBytes = 1 << 20

// MessageOptions returns the message options of every Connect handler of a
// service: ReadLimit(MaxMessageBytes) and the CompressMinBytes threshold.
// HandlerOptions includes them; a handler that goes without HandlerOptions
// (the gateway's Session) takes them alone.
func MessageOptions() []connect.HandlerOption {
	return []connect.HandlerOption{ReadLimit(MaxMessageBytes), connect.WithCompressMinBytes(CompressMinBytes)}
}

// ReadLimit returns the Connect handler option that bounds every message a
// handler reads to maxBytes, compressed or not: a larger message, or one
// that inflates beyond maxBytes, fails the call or ends the stream with
// ResourceExhausted, and the server's other calls and streams go on.
//
// connect.WithReadMaxBytes alone bounds the memory: connect-go (v1.21)
// refuses an envelope larger than the limit before reading it, and reads
// at most limit+1 decompressed bytes into memory. But when a message
// inflates beyond the limit it then inflates the rest into io.Discard, to
// report the size: a 1 MiB gzip bomb would cost the CPU of inflating 1 GiB.
// So gzip here (the one compression handlers accept) stops inflating past
// maxBytes+1 bytes ("gzip: the message inflates beyond N bytes").
func ReadLimit(maxBytes int) connect.HandlerOption {
	return connect.WithHandlerOptions(
		connect.WithReadMaxBytes(maxBytes),
		connect.WithCompression("gzip",
			func() connect.Decompressor { return &boundedGzip{max: int64(maxBytes) + 1} },
			func() connect.Compressor { return gzip.NewWriter(io.Discard) }),
	)
}

// boundedGzip is a gzip reader that fails once it returned max bytes of a
// message.
type boundedGzip struct {
	gzip.Reader
	max, n int64
}

func (b *boundedGzip) Read(p []byte) (int, error) {
	if b.n >= b.max {
		return 0, fmt.Errorf("gzip: the message inflates beyond %d bytes", b.max-1)
	}
	if rest := b.max - b.n; int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := b.Reader.Read(p)
	b.n += int64(n)
	return n, err
}

// Reset starts reading the message r.
func (b *boundedGzip) Reset(r io.Reader) error {
	b.n = 0
	return b.Reader.Reset(r)
}
