package sessionwire_test

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/sessionwire"
)

// FuzzReadMessage reads what a peer may send: ReadMessage never panics,
// refuses an envelope above the limit before reading its payload, and
// anything it decodes is re-encoded and read back the same.
func FuzzReadMessage(f *testing.F) {
	var hb bytes.Buffer
	_ = sessionwire.WriteMessage(&hb, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{Seq: 7}}})
	f.Add(hb.Bytes())
	var end bytes.Buffer
	_ = sessionwire.WriteEnd(&end, connect.NewError(connect.CodeAborted, errors.New("superseded")))
	f.Add(end.Bytes())
	f.Add([]byte{0, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{2, 0, 0, 0, 2, '{', '}'})
	f.Fuzz(func(t *testing.T, in []byte) {
		const limit = 4096
		r := bytes.NewReader(in)
		for {
			var m gatewayv1.SessionRequest
			before := r.Len()
			err := sessionwire.ReadMessage(r, &m, limit)
			if errors.Is(err, sessionwire.ErrTooLarge) && before-r.Len() != 5 {
				t.Fatalf("read %d bytes of an envelope over the limit, want its 5-byte prefix only", before-r.Len())
			}
			if err != nil {
				var cerr *connect.Error
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, sessionwire.ErrEnd) && !errors.As(err, &cerr) {
					t.Fatalf("ReadMessage = %v, not one of its documented errors", err)
				}
				return
			}
			var again bytes.Buffer
			if err := sessionwire.WriteMessage(&again, &m); err != nil {
				t.Fatalf("re-encode: %v", err)
			}
			var back gatewayv1.SessionRequest
			if err := sessionwire.ReadMessage(&again, &back, 1<<20); err != nil || !proto.Equal(&m, &back) {
				t.Fatalf("read back %v (%v), want %v", &back, err, &m)
			}
		}
	})
}
