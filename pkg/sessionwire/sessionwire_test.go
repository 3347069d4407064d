package sessionwire_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/sessionwire"
)

// server is a TLS listener on loopback whose connections serve runs.
type server struct {
	addr  string
	roots *x509.CertPool
}

// newServer listens with protos as its ALPN list and runs serve for each
// connection once its handshake is done.
func newServer(t *testing.T, protos []string, serve func(c *tls.Conn)) *server {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "gateway"},
		DNSNames: []string{"gateway"}, NotBefore: time.Unix(0, 0), NotAfter: time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, IsCA: true, BasicConstraintsValid: true,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(leaf)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}},
		NextProtos:   protos, MinVersion: tls.VersionTLS13,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				tc := c.(*tls.Conn)
				defer func() { _ = tc.Close() }()
				if tc.Handshake() == nil {
					serve(tc)
				}
			}()
		}
	}()
	return &server{addr: ln.Addr().String(), roots: roots}
}

func (s *server) stream(ctx context.Context, dial sessionwire.Dialer) *sessionwire.ClientStream {
	return sessionwire.NewClientStream(ctx, dial, s.addr, &tls.Config{RootCAs: s.roots, ServerName: "gateway",
		NextProtos: []string{"h2"}}, 1<<20)
}

func heartbeat(seq int64) *gatewayv1.SessionRequest {
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{Seq: seq}}}
}

func ack(seq int64) *gatewayv1.SessionResponse {
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: seq}}}
}

// TestStreamCarriesMessagesThenTheGatewaysError: messages both ways in
// order, the daemon's half-close read as io.EOF by the gateway, and the
// gateway's end of stream read by the daemon as the Connect error it
// carries.
func TestStreamCarriesMessagesThenTheGatewaysError(t *testing.T) {
	got := make(chan []int64, 1)
	srv := newServer(t, []string{sessionwire.ALPN, "h2"}, func(c *tls.Conn) {
		if p := c.ConnectionState().NegotiatedProtocol; p != sessionwire.ALPN {
			t.Errorf("negotiated %q, want %q", p, sessionwire.ALPN)
		}
		var seqs []int64
		for {
			var m gatewayv1.SessionRequest
			err := sessionwire.ReadMessage(c, &m, 1<<20)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Errorf("read: %v", err)
				return
			}
			seqs = append(seqs, m.GetHeartbeat().GetSeq())
			if err := sessionwire.WriteMessage(c, ack(m.GetHeartbeat().GetSeq())); err != nil {
				t.Errorf("write: %v", err)
			}
		}
		got <- seqs
		_ = sessionwire.WriteEnd(c, connect.NewError(connect.CodeAborted, errors.New("session superseded")))
	})
	s := srv.stream(t.Context(), nil)
	defer func() { _ = s.CloseResponse() }()
	for seq := int64(1); seq <= 3; seq++ {
		if err := s.Send(heartbeat(seq)); err != nil {
			t.Fatal(err)
		}
		m, err := s.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(ack(seq), m, protocmp.Transform()); diff != "" {
			t.Fatalf("ack (-want +got):\n%s", diff)
		}
	}
	if err := s.CloseRequest(); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int64{1, 2, 3}, <-got); diff != "" {
		t.Errorf("heartbeats the gateway read (-want +got):\n%s", diff)
	}
	_, err := s.Receive()
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeAborted || cerr.Message() != "session superseded" {
		t.Fatalf("Receive after the end = %v, want aborted: session superseded", err)
	}
}

// TestEndWithoutErrorIsEOF: an end of stream without error reads as io.EOF.
func TestEndWithoutErrorIsEOF(t *testing.T) {
	srv := newServer(t, []string{sessionwire.ALPN}, func(c *tls.Conn) { _ = sessionwire.WriteEnd(c, nil) })
	s := srv.stream(t.Context(), nil)
	defer func() { _ = s.CloseResponse() }()
	if _, err := s.Receive(); !errors.Is(err, io.EOF) {
		t.Fatalf("Receive = %v, want io.EOF", err)
	}
}

// TestConnectionLostIsUnavailable: a connection that ends with no end of
// stream, inside an envelope or between two, is Unavailable, "lost the
// connection".
func TestConnectionLostIsUnavailable(t *testing.T) {
	for name, sent := range map[string][]byte{
		"inside an envelope": {0, 0, 0, 0, 9, 1},
		"between envelopes":  {0, 0, 0, 0, 0},
	} {
		t.Run(name, func(t *testing.T) {
			srv := newServer(t, []string{sessionwire.ALPN}, func(c *tls.Conn) { _, _ = c.Write(sent) })
			s := srv.stream(t.Context(), nil)
			defer func() { _ = s.CloseResponse() }()
			var err error
			for range 2 {
				if _, err = s.Receive(); err != nil {
					break
				}
			}
			if connect.CodeOf(err) != connect.CodeUnavailable || !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("Receive = %v, want unavailable wrapping io.ErrUnexpectedEOF", err)
			}
		})
	}
}

// TestGatewayWithoutTheTransportIsUnsupported: a gateway that serves only
// h2 refuses the handshake, which IsUnsupported recognises (the daemon's
// cue to fall back to Connect); a refused dial is not that.
func TestGatewayWithoutTheTransportIsUnsupported(t *testing.T) {
	srv := newServer(t, []string{"h2"}, func(*tls.Conn) {})
	s := srv.stream(t.Context(), nil)
	defer func() { _ = s.CloseResponse() }()
	err := s.Send(heartbeat(1))
	if !sessionwire.IsUnsupported(err) || connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("Send = %v, want an unavailable no_application_protocol refusal", err)
	}
	ln, lerr := net.Listen("tcp", "127.0.0.1:0")
	if lerr != nil {
		t.Fatal(lerr)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	refused := sessionwire.NewClientStream(t.Context(), nil, addr, &tls.Config{}, 1<<20)
	if err := refused.Send(heartbeat(1)); err == nil || sessionwire.IsUnsupported(err) {
		t.Fatalf("Send to a closed port = %v, want a dial error that is not unsupported", err)
	}
}

// TestCancelEndsTheStream: cancelling the stream's context closes its
// connection; a Receive waiting returns Canceled.
func TestCancelEndsTheStream(t *testing.T) {
	srv := newServer(t, []string{sessionwire.ALPN}, func(c *tls.Conn) { _, _ = io.Copy(io.Discard, c) })
	ctx, cancel := context.WithCancel(t.Context())
	s := srv.stream(ctx, nil)
	defer func() { _ = s.CloseResponse() }()
	if err := s.Send(heartbeat(1)); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { _, err := s.Receive(); errc <- err }()
	cancel()
	if err := <-errc; connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("Receive after cancel = %v, want canceled", err)
	}
}

// TestClosedBeforeDialNeverDials: a stream closed before its first use
// never opens a connection.
func TestClosedBeforeDialNeverDials(t *testing.T) {
	var dials atomic.Int32
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	srv := newServer(t, []string{sessionwire.ALPN}, func(*tls.Conn) {})
	s := srv.stream(t.Context(), dial)
	if err := s.CloseResponse(); err != nil {
		t.Fatal(err)
	}
	if err := s.Send(heartbeat(1)); connect.CodeOf(err) != connect.CodeCanceled {
		t.Fatalf("Send after CloseResponse = %v, want canceled", err)
	}
	if n := dials.Load(); n != 0 {
		t.Fatalf("dials = %d, want none", n)
	}
}

// TestReadMessageRefuses: the limit, a truncated envelope, unknown flags,
// a payload that is not the message, and an end that is not JSON.
func TestReadMessageRefuses(t *testing.T) {
	var big bytes.Buffer
	if err := sessionwire.WriteMessage(&big, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Hello{
		Hello: &gatewayv1.Hello{NodeId: string(make([]byte, 2000))}}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		in    []byte
		limit int
		code  connect.Code // 0: not a Connect error
		err   error
	}{
		{name: "larger than the limit", in: big.Bytes(), limit: 1000, code: connect.CodeResourceExhausted, err: sessionwire.ErrTooLarge},
		{name: "truncated payload", in: []byte{0, 0, 0, 0, 4, 8}, limit: 100, err: io.ErrUnexpectedEOF},
		{name: "truncated prefix", in: []byte{0, 0}, limit: 100, err: io.ErrUnexpectedEOF},
		{name: "nothing", in: nil, limit: 100, err: io.EOF},
		{name: "unknown flags", in: []byte{1, 0, 0, 0, 0}, limit: 100, code: connect.CodeInvalidArgument},
		{name: "not the message", in: []byte{0, 0, 0, 0, 2, 0xff, 0xff}, limit: 100, code: connect.CodeInvalidArgument},
		{name: "end not JSON", in: []byte{2, 0, 0, 0, 1, '{'}, limit: 100, code: connect.CodeInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m gatewayv1.SessionRequest
			err := sessionwire.ReadMessage(bytes.NewReader(tc.in), &m, tc.limit)
			if err == nil {
				t.Fatal("ReadMessage accepted it")
			}
			if tc.code != 0 && connect.CodeOf(err) != tc.code {
				t.Errorf("code of %v = %v, want %v", err, connect.CodeOf(err), tc.code)
			}
			if tc.err != nil && !errors.Is(err, tc.err) {
				t.Errorf("err = %v, want %v", err, tc.err)
			}
		})
	}
}

// TestEndKeepsCodeAndMessage: WriteEnd then ReadMessage give back the
// code and message of a Connect error, Unknown for another error.
func TestEndKeepsCodeAndMessage(t *testing.T) {
	for _, tc := range []struct {
		in   error
		code connect.Code
		msg  string
	}{
		{connect.NewError(connect.CodeUnauthenticated, errors.New("certificate revoked")), connect.CodeUnauthenticated, "certificate revoked"},
		{errors.New("boom"), connect.CodeUnknown, "boom"},
	} {
		var b bytes.Buffer
		if err := sessionwire.WriteEnd(&b, tc.in); err != nil {
			t.Fatal(err)
		}
		err := sessionwire.ReadMessage(&b, new(gatewayv1.SessionResponse), 100)
		var cerr *connect.Error
		if !errors.As(err, &cerr) || cerr.Code() != tc.code || cerr.Message() != tc.msg {
			t.Errorf("end of %v read as %v, want %v: %s", tc.in, err, tc.code, tc.msg)
		}
	}
}
