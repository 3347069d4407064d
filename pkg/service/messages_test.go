package service_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// echoServer serves /test.Echo/Unary, which answers the length of the
// string it is sent, /test.Echo/Stream, a client stream answering the
// total length of the strings it is sent, both with service.HandlerOptions,
// and /test.Echo/Busy, which refuses every call with ResourceExhausted as a
// quota would, all behind service.ContentTooLarge as NewServer serves them.
func echoServer(t *testing.T) *httptest.Server {
	t.Helper()
	opts := service.HandlerOptions(telemetry.Discard())
	mux := http.NewServeMux()
	mux.Handle("/test.Echo/Unary", connect.NewUnaryHandler("/test.Echo/Unary",
		func(_ context.Context, req *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.Int64Value], error) {
			return connect.NewResponse(wrapperspb.Int64(int64(len(req.Msg.GetValue())))), nil
		}, opts...))
	mux.Handle("/test.Echo/Stream", connect.NewClientStreamHandler("/test.Echo/Stream",
		func(_ context.Context, s *connect.ClientStream[wrapperspb.StringValue]) (*connect.Response[wrapperspb.Int64Value], error) {
			var n int64
			for s.Receive() {
				n += int64(len(s.Msg().GetValue()))
			}
			if err := s.Err(); err != nil {
				return nil, err
			}
			return connect.NewResponse(wrapperspb.Int64(n)), nil
		}, opts...))
	mux.Handle("/test.Echo/Busy", connect.NewUnaryHandler("/test.Echo/Busy",
		func(_ context.Context, _ *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.Int64Value], error) {
			return nil, connect.NewError(connect.CodeResourceExhausted, errors.New("quota: too many GPUs"))
		}, opts...))
	srv := httptest.NewServer(service.ContentTooLarge(mux))
	t.Cleanup(srv.Close)
	return srv
}

// TestMessageLimitStatus checks what a plain HTTP client sees of a Connect
// unary call whose message is beyond service.MaxMessageBytes, raw or
// inflated: HTTP 413 with the Connect error resource_exhausted in the body;
// and that another ResourceExhausted refusal keeps its 429.
func TestMessageLimitStatus(t *testing.T) {
	t.Parallel()
	srv := echoServer(t)
	big, err := proto.Marshal(wrapperspb.String(strings.Repeat("x", service.MaxMessageBytes)))
	require.NoError(t, err)
	var zipped bytes.Buffer
	zw := gzip.NewWriter(&zipped)
	_, err = zw.Write(big)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	type answer struct {
		Status int
		Code   string
	}
	post := func(t *testing.T, path, contentType, encoding string, body []byte) answer {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+path, bytes.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", contentType)
		if encoding != "" {
			req.Header.Set("Content-Encoding", encoding)
		}
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		var wire struct {
			Code string `json:"code"`
		}
		require.NoError(t, json.NewDecoder(res.Body).Decode(&wire))
		return answer{res.StatusCode, wire.Code}
	}
	tooLarge := answer{http.StatusRequestEntityTooLarge, "resource_exhausted"}
	t.Run("raw", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, tooLarge, post(t, "/test.Echo/Unary", "application/proto", "", big))
	})
	t.Run("gzip", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, tooLarge, post(t, "/test.Echo/Unary", "application/proto", "gzip", zipped.Bytes()))
	})
	t.Run("json", func(t *testing.T) {
		t.Parallel()
		body := `{"value":"` + strings.Repeat("x", service.MaxMessageBytes) + `"}`
		require.Equal(t, tooLarge, post(t, "/test.Echo/Unary", "application/json; charset=utf-8", "", []byte(body)))
	})
	t.Run("quota", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, answer{http.StatusTooManyRequests, "resource_exhausted"},
			post(t, "/test.Echo/Busy", "application/proto", "", nil))
	})
}

// TestMessageLimit checks that the shared handler options refuse a message
// beyond service.MaxMessageBytes with ResourceExhausted, in a unary call
// and in a stream, whether it is sent as it is or as a gzip bomb (a small
// compressed message that inflates far beyond the limit, which must stop
// inflating at the limit), and take messages up to the limit, compressed or
// not.
func TestMessageLimit(t *testing.T) {
	t.Parallel()
	srv := echoServer(t)
	// A StringValue's encoding is its string and 4 bytes of tag and length.
	fits, beyond := service.MaxMessageBytes-4, service.MaxMessageBytes+1
	const bomb = 256 << 20 // 256 MiB of one letter: about 250 KiB of gzip
	for _, c := range []struct {
		name string
		size int
		gzip bool
		// err is what the error says; "" for success.
		err string
	}{
		{name: "at the limit", size: fits},
		{name: "at the limit, compressed", size: fits, gzip: true},
		{name: "beyond the limit", size: beyond, err: "larger than configured max"},
		{name: "beyond the limit, compressed", size: beyond, gzip: true, err: "inflates beyond 1048576 bytes"},
		{name: "gzip bomb", size: bomb, gzip: true, err: "inflates beyond 1048576 bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var opts []connect.ClientOption
			if c.gzip {
				opts = append(opts, connect.WithSendGzip())
			}
			msg := wrapperspb.String(strings.Repeat("x", c.size))
			unary := connect.NewClient[wrapperspb.StringValue, wrapperspb.Int64Value](http.DefaultClient, srv.URL+"/test.Echo/Unary", opts...)
			res, err := unary.CallUnary(t.Context(), connect.NewRequest(msg))
			check(t, "unary", c.err, int64(c.size), res, err)

			stream := connect.NewClient[wrapperspb.StringValue, wrapperspb.Int64Value](http.DefaultClient, srv.URL+"/test.Echo/Stream", opts...).
				CallClientStream(t.Context())
			err = stream.Send(wrapperspb.String("small"))
			if err == nil {
				err = stream.Send(msg)
			}
			if errors.Is(err, io.EOF) {
				err = nil // the server ended the stream: CloseAndReceive says why
			}
			require.NoError(t, err)
			res, err = stream.CloseAndReceive()
			check(t, "stream", c.err, int64(c.size)+5, res, err)
		})
	}
}

func check(t *testing.T, what, wantErr string, wantLen int64, res *connect.Response[wrapperspb.Int64Value], err error) {
	t.Helper()
	if wantErr == "" {
		require.NoError(t, err, what)
		require.Equal(t, wantLen, res.Msg.GetValue(), what)
		return
	}
	require.Equal(t, connect.CodeResourceExhausted, connect.CodeOf(err), "%s: %v", what, err)
	require.Contains(t, err.Error(), wantErr, what)
}
