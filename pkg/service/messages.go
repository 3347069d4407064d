package service

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

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

// ContentTooLarge makes next answer HTTP 413 (Content Too Large, RFC 9110
// section 15.5.14) instead of 429 to a Connect unary call (a POST of
// application/proto or application/json) that was refused for a request
// message beyond its read limit (ReadLimit), so that plain HTTP clients and
// proxies do not take the refusal for a rate limit and retry it. The
// Connect error in the body is left as it is: a Connect client still sees
// ResourceExhausted ("message size N is larger than configured max M"),
// since Connect clients take the code from the body (Connect protocol,
// "Unary-Response"). Other refusals keep their status (a rate limit's 429
// with Retry-After, a quota's 429), and so do streams and gRPC, whose HTTP
// status is 200 with the code at the end of the stream. NewServer wraps
// every handler in it.
func ContentTooLarge(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || !connectUnary(r.Header.Get("Content-Type")) {
			next.ServeHTTP(w, r)
			return
		}
		tw := &tooLargeWriter{ResponseWriter: w}
		next.ServeHTTP(tw, r)
		tw.release()
	})
}

// connectUnary reports whether contentType is a Connect unary request's
// (application/<codec>, not Connect streaming's application/connect+<codec>
// nor gRPC's).
func connectUnary(contentType string) bool {
	ct, _, _ := strings.Cut(contentType, ";")
	ct = strings.ToLower(strings.TrimSpace(ct))
	return ct == "application/proto" || ct == "application/json"
}

// tooLargeMarker is what connect-go's refusal of a message beyond the read
// limit says, raw or decompressed (TestMessageLimit pins it).
const tooLargeMarker = "larger than configured max"

// maxHeldErrorBytes bounds the error body tooLargeWriter holds back: a
// Connect error's JSON is far smaller; a larger body is passed on as it is.
const maxHeldErrorBytes = 64 << 10

// tooLargeWriter holds back a 429 answer, and its body, until the handler
// returns (or flushes), to tell a message-size refusal from the others.
type tooLargeWriter struct {
	http.ResponseWriter
	held bool
	body []byte
}

func (w *tooLargeWriter) WriteHeader(status int) {
	if status == http.StatusTooManyRequests && !w.held && w.body == nil {
		w.held = true
		return
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *tooLargeWriter) Write(p []byte) (int, error) {
	if !w.held {
		return w.ResponseWriter.Write(p)
	}
	if len(w.body)+len(p) > maxHeldErrorBytes {
		w.release()
		return w.ResponseWriter.Write(p)
	}
	w.body = append(w.body, p...)
	return len(p), nil
}

// Flush sends what is held, deciding its status on what was written so far.
func (w *tooLargeWriter) Flush() {
	w.release()
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap gives http.ResponseController the writer underneath.
func (w *tooLargeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// release writes the held status, 413 for a message-size refusal, and the
// held body.
func (w *tooLargeWriter) release() {
	if !w.held {
		return
	}
	w.held = false
	status := http.StatusTooManyRequests
	var wire struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	if json.Unmarshal(w.body, &wire) == nil && wire.Code == connect.CodeResourceExhausted.String() &&
		strings.Contains(wire.Message, tooLargeMarker) {
		status = http.StatusRequestEntityTooLarge
	}
	w.ResponseWriter.WriteHeader(status)
	body := w.body
	w.body = nil
	if len(body) > 0 {
		_, _ = w.ResponseWriter.Write(body)
	}
}
