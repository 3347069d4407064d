package gateway_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/pki"
)

// nodeCerts stands in for JoinService's NodeCertService, which decides and
// signs renewals (its own tests cover that: services/joinservice): served as
// JoinService's control listener is, over mutual TLS with joinservice.crt,
// taking only the serving CA's client certificates (the gateways'). It signs
// every renewal it is asked for with the test PKI's node CA for the
// request's node, valid for ttl from the env's clock, and records it in
// node_certs, or answers refuse when that is set; it keeps every request.
type nodeCerts struct {
	e   *env
	url string

	mu     sync.Mutex
	ttl    time.Duration
	refuse error
	reqs   []*joinv1.RenewNodeCertificateRequest
	// hold, when set, makes each call wait until it is closed (or the
	// call's context ends) before it answers.
	hold chan struct{}
}

var _ joinv1connect.NodeCertServiceHandler = (*nodeCerts)(nil)

// startNodeCerts serves a nodeCerts until the test ends.
func (e *env) startNodeCerts() *nodeCerts {
	e.t.Helper()
	nc := &nodeCerts{e: e, ttl: 24 * time.Hour}
	cert, err := tls.LoadX509KeyPair(filepath.Join(e.pkiDir, pki.JoinServiceCert), filepath.Join(e.pkiDir, pki.JoinServiceKey))
	require.NoError(e.t, err)
	mux := http.NewServeMux()
	mux.Handle(joinv1connect.NewNodeCertServiceHandler(nc))
	ts := httptest.NewUnstartedServer(mux)
	ts.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: e.servingCAs, ClientAuth: tls.RequireAndVerifyClientCert,
		MinVersion: tls.VersionTLS13}
	ts.EnableHTTP2 = true
	ts.StartTLS()
	e.t.Cleanup(ts.Close)
	nc.url = ts.URL
	return nc
}

// RenewNodeCertificate signs the CSR, or refuses with refuse.
func (nc *nodeCerts) RenewNodeCertificate(ctx context.Context, req *connect.Request[joinv1.RenewNodeCertificateRequest]) (
	*connect.Response[joinv1.RenewNodeCertificateResponse], error) {
	nc.mu.Lock()
	nc.reqs = append(nc.reqs, proto.Clone(req.Msg).(*joinv1.RenewNodeCertificateRequest))
	refuse, ttl, hold := nc.refuse, nc.ttl, nc.hold
	nc.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, connect.NewError(connect.CodeCanceled, ctx.Err())
		}
	}
	if refuse != nil {
		return nil, refuse
	}
	csr, err := pki.ParseCSR(req.Msg.GetCsrDer())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	cert, err := nc.e.nodeCA.IssueNode(csr, req.Msg.GetNodeId(), nc.e.trustDomain, nc.e.clk.Now(), ttl)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	nc.e.recordCert(req.Msg.GetNodeId(), cert, time.Time{})
	return connect.NewResponse(&joinv1.RenewNodeCertificateResponse{CertificateDer: cert.Raw, NotAfter: timestamppb.New(cert.NotAfter)}), nil
}

// setRefuse makes every later call answer err (none when nil).
func (nc *nodeCerts) setRefuse(err error) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	nc.refuse = err
}

// holdCalls makes every later call wait until release is called.
func (nc *nodeCerts) holdCalls() (release func()) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	hold := make(chan struct{})
	nc.hold = hold
	return sync.OnceFunc(func() { close(hold) })
}

// setTTL makes the certificates signed from now on valid for ttl.
func (nc *nodeCerts) setTTL(ttl time.Duration) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	nc.ttl = ttl
}

// last returns the last request received, failing the test when none was.
func (nc *nodeCerts) last() *joinv1.RenewNodeCertificateRequest {
	nc.e.t.Helper()
	nc.mu.Lock()
	defer nc.mu.Unlock()
	require.NotEmpty(nc.e.t, nc.reqs, "NodeCertService was called")
	return nc.reqs[len(nc.reqs)-1]
}

// calls returns how many requests were received.
func (nc *nodeCerts) calls() int {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	return len(nc.reqs)
}

// renewalOf returns what a gateway relays of a renewal on the session of a
// node whose client certificate is client and whose session rests on
// session: the request NodeCertService must get.
func renewalOf(id string, client, session *x509.Certificate, csr, proof []byte) *joinv1.RenewNodeCertificateRequest {
	return &joinv1.RenewNodeCertificateRequest{NodeId: id, ClientCertSerial: pki.SerialHex(client), SessionCertDer: session.Raw,
		CsrDer: csr, Proof: proof}
}
