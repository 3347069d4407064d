package agent_test

import (
	"context"
	"crypto"
	"crypto/ecdh"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
	"github.com/better-compute/better-compute/pkg/syncbuf"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	goodToken   = "bcjt_good_token_1234"
	trustDomain = "compute.test.local"
	waitFor     = 10 * time.Second
	tick        = 5 * time.Millisecond
)

// controlPlane is a fake JoinService (plain HTTP, which also serves the
// well-known document) and a fake gateway (HTTP/2 over mutual TLS) made
// from throwaway CAs and keys.
type controlPlane struct {
	t         *testing.T
	nodeCA    *pki.CA
	servingCA *pki.CA
	join      *fakeJoin
	gw        *fakeGateway
	joinURL   string
	gwURL     string
	gwTLS     tls.Certificate // the gateways' serving certificate
	// gwServer serves gw, the first gateway (CloseClientConnections drops
	// the sessions' connections).
	gwServer *httptest.Server
	// pins are the deployment's pins, as pins.json would hold them.
	pins pki.Pins
	// joinConns counts the connections the join server accepted.
	joinConns atomic.Int64
}

func newControlPlane(t *testing.T, maxUses int) *controlPlane {
	t.Helper()
	now := clock.New().Now()
	nodeCA, err := pki.NewCA("test node CA", now, time.Hour)
	require.NoError(t, err)
	servingCA, err := pki.NewCA("test serving CA", now, time.Hour)
	require.NoError(t, err)
	gwCert, gwKey, err := servingCA.IssueServing([]string{"localhost", "127.0.0.1"}, now, time.Hour)
	require.NoError(t, err)

	cp := &controlPlane{t: t, nodeCA: nodeCA, servingCA: servingCA,
		gwTLS: tls.Certificate{Certificate: [][]byte{gwCert.Raw}, PrivateKey: gwKey, Leaf: gwCert}}
	gw := newFakeGateway("gw-test")
	gwURL := cp.serveGateway(gw)

	joinKey, err := pki.GenerateJoinEncryptionKey()
	require.NoError(t, err)
	signKey, err := pki.GenerateSigningKey()
	require.NoError(t, err)
	commandKey, err := pki.GenerateSigningKey()
	require.NoError(t, err)
	j := &fakeJoin{nodeCA: nodeCA, servingCA: servingCA, gatewayURL: gwURL, serverName: "localhost", maxUses: maxUses,
		joinKey: joinKey, signKey: signKey}
	jmux := http.NewServeMux()
	jmux.Handle(joinv1connect.NewJoinServiceHandler(j))
	jsrv := httptest.NewUnstartedServer(jmux)
	jsrv.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateNew {
			cp.joinConns.Add(1)
		}
	}
	jsrv.Start()
	t.Cleanup(jsrv.Close)
	jmux.Handle("GET "+pki.WellKnownPath, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(j.wellKnown(jsrv.URL))
	}))
	cp.join, cp.gw, cp.joinURL, cp.gwURL = j, gw, jsrv.URL, gwURL
	cp.pins.ServingCA = pki.PinOfSPKI(servingCA.Cert.RawSubjectPublicKeyInfo)
	cp.pins.JoinSigning, err = pki.SPKIPin(signKey.Public())
	require.NoError(t, err)
	cp.pins.JoinEncryption, err = pki.SPKIPin(joinKey.PublicKey())
	require.NoError(t, err)
	cp.pins.CommandSigning, err = pki.SPKIPin(commandKey.Public())
	require.NoError(t, err)
	j.commandRoot, err = x509.MarshalPKIXPublicKey(commandKey.Public())
	require.NoError(t, err)
	return cp
}

func newFakeGateway(id string) *fakeGateway {
	return &fakeGateway{id: id, heartbeat: 50 * time.Millisecond, sessions: map[string]*gwSession{}, msgs: map[string][]*gatewayv1.SessionRequest{},
		hellos: map[string][]*gatewayv1.Hello{}, revoked: map[string]bool{}, refused: map[string]int{},
		tunnelWaits: map[string]tunnelWait{}}
}

// serveGateway serves gw with mutual TLS (the deployment's serving
// certificate, node certificates of its node CA) over the framed session
// transport and HTTP/2, as the real gateway does, until the test ends, and
// returns its URL.
func (cp *controlPlane) serveGateway(gw *fakeGateway) string {
	return cp.serveGatewayWith(gw, true)
}

// serveGatewayWith is serveGateway; without framed, gw serves sessions over
// HTTP/2 only, as a gateway that does not know the framed transport.
func (cp *controlPlane) serveGatewayWith(gw *fakeGateway, framed bool) string {
	mux := http.NewServeMux()
	path, h := gatewayv1connect.NewGatewayServiceHandler(gw)
	mux.Handle(path, peerMiddleware(h))
	gsrv := httptest.NewUnstartedServer(mux)
	gsrv.EnableHTTP2 = true
	gsrv.TLS = &tls.Config{
		Certificates: []tls.Certificate{cp.gwTLS},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    cp.nodeCA.Pool(),
		MinVersion:   tls.VersionTLS12,
	}
	if framed {
		gsrv.TLS.NextProtos = []string{sessionwire.ALPN, "h2"}
		// With Protocols set, net/http adds its HTTP/2 server to the map.
		var p http.Protocols
		p.SetHTTP1(true)
		p.SetHTTP2(true)
		gsrv.Config.Protocols = &p
		gsrv.Config.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){sessionwire.ALPN: gw.serveFramed}
	}
	gsrv.StartTLS()
	cp.t.Cleanup(gsrv.Close)
	if cp.gwServer == nil {
		cp.gwServer = gsrv
	}
	return gsrv.URL
}

// config returns a Runner configuration with fast timings that joins
// from the well-known document with the deployment's pins.
func (cp *controlPlane) config(dir string, nodes int) agent.Config {
	return agent.Config{
		Server:  cp.joinURL,
		Pins:    cp.pins,
		Token:   goodToken,
		DataDir: dir,
		Nodes:   nodes,
		// AgentVersion is reported in the Join claims and Hello.
		AgentVersion: testVersion,
		Core: daemon.Config{
			BackoffMin:     5 * time.Millisecond,
			BackoffMax:     100 * time.Millisecond,
			RebootDowntime: 50 * time.Millisecond,
		},
		JoinBackoffMin: 5 * time.Millisecond,
		JoinBackoffMax: 20 * time.Millisecond,
	}
}

type peerKey struct{}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func peerMiddleware(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
			http.Error(w, "client certificate required", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), peerKey{}, r.TLS.PeerCertificates[0])))
	})
}

type fakeJoin struct {
	nodeCA, servingCA *pki.CA
	gatewayURL        string
	serverName        string
	joinKey           *ecdh.PrivateKey   // opens sealed tokens
	signKey           ed25519.PrivateKey // signs JoinResponses

	mu        sync.Mutex
	maxUses   int
	uses      int
	calls     int
	failFirst int  // answer Unavailable this many times first
	hangFirst bool // answer the first call never
	claims    []*joinv1.Claims
	requests  []*joinv1.JoinRequest
	// signedIntent sends commandRoot in the response's trust.
	signedIntent bool
	commandRoot  []byte
	// edit changes the response before it is signed, tamper after.
	edit, tamper func(*joinv1.JoinResponse)
	// signWith, when set, signs responses instead of signKey (which the
	// well-known document keeps naming).
	signWith ed25519.PrivateKey
	// editDoc changes the well-known document.
	editDoc func(*pki.WellKnown)
	// together, when above 0, holds each Join's answer until that many
	// Joins are answered (then the next that many, and so on): their
	// answers go out together.
	together int
	arrived  int
	allIn    chan struct{}
}

// gather holds a Join's answer until j.together Joins of its round are
// answered (see together), or ctx ends.
func (j *fakeJoin) gather(ctx context.Context) {
	j.mu.Lock()
	if j.together <= 0 {
		j.mu.Unlock()
		return
	}
	if j.arrived%j.together == 0 {
		j.allIn = make(chan struct{})
	}
	j.arrived++
	all := j.allIn
	if j.arrived%j.together == 0 {
		close(all)
	}
	j.mu.Unlock()
	select {
	case <-all:
	case <-ctx.Done():
	}
}

// wellKnown returns the document the fake deployment publishes.
func (j *fakeJoin) wellKnown(joinURL string) pki.WellKnown {
	j.mu.Lock()
	defer j.mu.Unlock()
	enc, err := x509.MarshalPKIXPublicKey(j.joinKey.PublicKey())
	if err != nil {
		panic(err)
	}
	sig, err := x509.MarshalPKIXPublicKey(j.signKey.Public())
	if err != nil {
		panic(err)
	}
	doc := pki.WellKnown{
		BaseURL: joinURL, JoinURL: joinURL,
		Gateway:           pki.WellKnownGateway{URLs: []string{j.gatewayURL}, ServerName: j.serverName},
		JoinEncryptionKey: enc, JoinSigningKey: sig, CommandSigningKey: j.commandRoot,
		ServingCA: string(pki.EncodeCertPEM(j.servingCA.Cert)),
	}
	doc.Pins.ServingCA = pki.PinOfSPKI(j.servingCA.Cert.RawSubjectPublicKeyInfo)
	doc.Pins.JoinEncryption, doc.Pins.JoinSigning = pki.PinOfSPKI(enc), pki.PinOfSPKI(sig)
	if j.editDoc != nil {
		j.editDoc(&doc)
	}
	return doc
}

func (j *fakeJoin) Join(ctx context.Context, req *connect.Request[joinv1.JoinRequest]) (*connect.Response[joinv1.JoinResponse], error) {
	res, err := j.join(ctx, req)
	j.gather(ctx)
	return res, err
}

func (j *fakeJoin) join(ctx context.Context, req *connect.Request[joinv1.JoinRequest]) (*connect.Response[joinv1.JoinResponse], error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.calls++
	j.requests = append(j.requests, req.Msg)
	if j.hangFirst && j.calls == 1 {
		// The answer never comes: the caller gives up (or is stopped).
		j.mu.Unlock()
		<-ctx.Done()
		j.mu.Lock()
		return nil, connect.NewError(connect.CodeCanceled, ctx.Err())
	}
	if j.failFirst > 0 {
		j.failFirst--
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("database is starting"))
	}
	token, err := pki.OpenJoinToken(j.joinKey, req.Msg.GetSealedToken(), req.Msg.GetCsrDer())
	if err != nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	if token != goodToken {
		return nil, connect.NewError(connect.CodePermissionDenied, errors.New("join token is invalid"))
	}
	if j.uses >= j.maxUses {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("join token is used up (%d of %d uses)", j.uses, j.maxUses))
	}
	csr, err := pki.ParseCSR(req.Msg.GetCsrDer())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	now := clock.New().Now()
	nodeID := ids.New(ids.Node, now)
	cert, err := j.nodeCA.IssueNode(csr, nodeID, trustDomain, now, time.Hour)
	if err != nil {
		return nil, err
	}
	j.uses++
	j.claims = append(j.claims, req.Msg.GetClaims())
	resp := &joinv1.JoinResponse{
		NodeId:            nodeID,
		CertificateDer:    cert.Raw,
		NodeCaDer:         j.nodeCA.Cert.Raw,
		GatewayUrls:       []string{j.gatewayURL},
		GatewayServerName: j.serverName,
		ServingCaDer:      j.servingCA.Cert.Raw,
		TrustDomain:       trustDomain,
		NotAfter:          timestamppb.New(cert.NotAfter),
		PoolId:            "pool_test",
	}
	if j.signedIntent {
		resp.Trust = &joinv1.Trust{CommandSigningRoot: j.commandRoot}
	}
	if j.edit != nil {
		j.edit(resp)
	}
	signer := j.signKey
	if j.signWith != nil {
		signer = j.signWith
	}
	if err := pki.SignJoinResponse(signer, resp); err != nil {
		return nil, err
	}
	if j.tamper != nil {
		j.tamper(resp)
	}
	return connect.NewResponse(resp), nil
}

func (j *fakeJoin) stats() (calls, uses int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.calls, j.uses
}

type fakeGateway struct {
	gatewayv1connect.UnimplementedGatewayServiceHandler
	id        string // Welcome.gateway_id
	heartbeat time.Duration

	mu       sync.Mutex
	seq      int
	sessions map[string]*gwSession
	hellos   map[string][]*gatewayv1.Hello
	msgs     map[string][]*gatewayv1.SessionRequest
	// revoked nodes are refused as the gateway does (Unauthenticated
	// "certificate revoked"); refused counts their refusals.
	revoked map[string]bool
	refused map[string]int
	// tunnelWaits are the tunnels sent in OpenTunnel whose node has not
	// dialled back yet, by tunnel id (tunnel_test.go).
	tunnelWaits map[string]tunnelWait
	framed      int // sessions served over the framed transport
}

type gwSession struct {
	out    chan *gatewayv1.SessionResponse
	kick   chan struct{}
	revoke chan struct{}
}

// errRevoked is the gateway's refusal of a revoked node or certificate.
var errRevoked = connect.NewError(connect.CodeUnauthenticated, errors.New("certificate revoked"))

// serverStream is the gateway's end of a session: Connect's BidiStream or
// a framedServer.
type serverStream interface {
	Send(*gatewayv1.SessionResponse) error
	Receive() (*gatewayv1.SessionRequest, error)
}

// framedServer is a session over the framed transport (pkg/sessionwire).
type framedServer struct{ c *tls.Conn }

func (f framedServer) Send(m *gatewayv1.SessionResponse) error {
	return sessionwire.WriteMessage(f.c, m)
}

func (f framedServer) Receive() (*gatewayv1.SessionRequest, error) {
	m := new(gatewayv1.SessionRequest)
	return m, sessionwire.ReadMessage(f.c, m, 1<<20)
}

// serveFramed serves one framed session on c, as the real gateway does:
// it ends the stream with what ended the session, and closes c.
func (g *fakeGateway) serveFramed(_ *http.Server, c *tls.Conn, _ http.Handler) {
	defer func() { _ = c.Close() }()
	g.mu.Lock()
	g.framed++
	g.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := c.ConnectionState()
	err := g.serve(ctx, cs.PeerCertificates[0], framedServer{c})
	_ = sessionwire.WriteEnd(c, err)
}

// framedSessions is how many sessions came over the framed transport.
func (g *fakeGateway) framedSessions() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.framed
}

func (g *fakeGateway) Session(ctx context.Context, stream *connect.BidiStream[gatewayv1.SessionRequest, gatewayv1.SessionResponse]) error {
	cert, _ := ctx.Value(peerKey{}).(*x509.Certificate)
	return g.serve(ctx, cert, stream)
}

func (g *fakeGateway) serve(ctx context.Context, cert *x509.Certificate, stream serverStream) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("first message must be Hello"))
	}
	certNode, err := pki.NodeIDFromCert(cert, trustDomain)
	if err != nil || certNode != hello.GetNodeId() {
		return connect.NewError(connect.CodePermissionDenied, errors.New("certificate does not match Hello.node_id"))
	}
	g.mu.Lock()
	if g.revoked[certNode] {
		g.refused[certNode]++
		g.mu.Unlock()
		return errRevoked
	}
	g.mu.Unlock()
	s := &gwSession{out: make(chan *gatewayv1.SessionResponse, 16), kick: make(chan struct{}), revoke: make(chan struct{})}
	g.mu.Lock()
	g.seq++
	epoch := g.seq
	sid := fmt.Sprintf("ses_%d", epoch)
	g.sessions[certNode] = s
	g.hellos[certNode] = append(g.hellos[certNode], hello)
	g.mu.Unlock()
	if err := stream.Send(&gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{Welcome: &gatewayv1.Welcome{
		SessionId: sid, GatewayId: g.id, HeartbeatInterval: durationpb.New(g.heartbeat), SessionEpoch: int64(epoch),
	}}}); err != nil {
		return err
	}
	recvErr := make(chan error, 1)
	go func() {
		for {
			m, err := stream.Receive()
			if err != nil {
				recvErr <- err
				return
			}
			g.mu.Lock()
			g.msgs[certNode] = append(g.msgs[certNode], m)
			g.mu.Unlock()
			if hb := m.GetHeartbeat(); hb != nil { // as the real gateway does
				select {
				case s.out <- &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: hb.GetSeq()}}}:
				default: // the sender is busy: what it sends answers
				}
			}
		}
	}()
	for {
		select {
		case m := <-s.out:
			if err := stream.Send(m); err != nil {
				return err
			}
		case <-s.kick:
			return connect.NewError(connect.CodeUnavailable, errors.New("gateway going away"))
		case <-s.revoke:
			return errRevoked
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (g *fakeGateway) session(node string) *gwSession {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.sessions[node]
}

func (g *fakeGateway) send(t *testing.T, node string, m *gatewayv1.SessionResponse) {
	t.Helper()
	s := g.session(node)
	require.NotNil(t, s, "no session of %s", node)
	s.out <- m
}

func (g *fakeGateway) kick(t *testing.T, node string) {
	t.Helper()
	s := g.session(node)
	require.NotNil(t, s)
	close(s.kick)
}

// revoke revokes node: its session is closed with the gateway's revocation
// error and every later one refused.
func (g *fakeGateway) revoke(t *testing.T, node string) {
	t.Helper()
	g.mu.Lock()
	g.revoked[node] = true
	s := g.sessions[node]
	g.mu.Unlock()
	require.NotNil(t, s)
	close(s.revoke)
}

func (g *fakeGateway) refusals(node string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.refused[node]
}

func (g *fakeGateway) received(node string) []*gatewayv1.SessionRequest {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*gatewayv1.SessionRequest(nil), g.msgs[node]...)
}

func (g *fakeGateway) helloes(node string) []*gatewayv1.Hello {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*gatewayv1.Hello(nil), g.hellos[node]...)
}

// updates returns the command updates the gateway received for command id.
func (g *fakeGateway) updates(node, id string) []*gatewayv1.CommandUpdate {
	var out []*gatewayv1.CommandUpdate
	for _, m := range g.received(node) {
		if u := m.GetCommandUpdate(); u != nil && u.GetCommandId() == id {
			out = append(out, u)
		}
	}
	return out
}

func command(id, kind string) *gatewayv1.SessionResponse {
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Command{Command: &gatewayv1.Command{
		CommandId: id, Kind: kind, Deadline: timestamppb.New(clock.New().Now().Add(time.Hour)),
	}}}
}

// start runs a Runner until the test ends.
func start(t *testing.T, cfg agent.Config, deps agent.Deps) (*agent.Runner, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	r, err := startRunner(ctx, cfg, deps)
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		<-r.Done()
	})
	return r, cancel
}

// dirNames returns the names of the files in dir.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	require.NoError(t, err)
	names := make([]string, 0, len(des))
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

func waitEstablished(t *testing.T, r *agent.Runner) {
	t.Helper()
	stopped := false
	require.Eventually(t, func() bool {
		select {
		case <-r.Done():
			stopped = true
			return true
		default:
		}
		for _, m := range r.Machines() {
			if m.State() != daemon.StateEstablished {
				return false
			}
		}
		return true
	}, waitFor, tick)
	if stopped {
		require.NoError(t, r.Wait())
		require.FailNow(t, "the runner stopped")
	}
}

func TestJoinSessionCommandsAndSpec(t *testing.T) {
	cp := newControlPlane(t, 10)
	dir := t.TempDir()
	r, _ := start(t, cp.config(dir, 3), agent.Deps{})
	waitEstablished(t, r)
	require.NoError(t, r.Ready())

	nodes := map[string]bool{}
	for i, m := range r.Machines() {
		st := m.Status()
		require.Equal(t, i, st.Index)
		require.True(t, st.Joined)
		require.Equal(t, "hgx-h100", st.Variant)
		require.NotEmpty(t, st.SessionID)
		require.NotEmpty(t, st.BootID)
		require.False(t, nodes[st.NodeID], "distinct node ids")
		nodes[st.NodeID] = true
		require.Equal(t, filepath.Join(dir, fmt.Sprint(i)), m.Dir())
		hello := cp.gw.helloes(st.NodeID)[0]
		require.Equal(t, st.BootID, hello.GetBootId())
		require.Equal(t, testVersion, hello.GetAgentVersion())
		// Joining wrote two files: an empty journal, then the identity,
		// owner-only.
		require.ElementsMatch(t, []string{agent.NodeFile, agent.JournalFile}, dirNames(t, m.Dir()))
		fi, err := os.Stat(filepath.Join(m.Dir(), agent.NodeFile))
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
		// The identity records what the Join said.
		raw, err := os.ReadFile(filepath.Join(m.Dir(), agent.NodeFile))
		require.NoError(t, err)
		var ident agent.Identity
		require.NoError(t, json.Unmarshal(raw, &ident))
		require.Equal(t, st.NodeID, ident.NodeID)
		require.Equal(t, st.MachineID, ident.MachineID)
		require.Equal(t, []string{cp.gwURL}, ident.GatewayURLs)
		require.Equal(t, "localhost", ident.GatewayServerName)
		require.Equal(t, "pool_test", ident.PoolID)
		require.Equal(t, trustDomain, ident.TrustDomain)
		cert, err := pki.ParseCertPEM([]byte(ident.CertificatePEM))
		require.NoError(t, err)
		certNode, err := pki.NodeIDFromCert(cert, trustDomain)
		require.NoError(t, err)
		require.Equal(t, st.NodeID, certNode)
		key, err := pki.ParseKeyPEM([]byte(ident.KeyPEM))
		require.NoError(t, err)
		require.True(t, key.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(cert.PublicKey), "the key is the certificate's")
		servingCA, err := pki.ParseCertPEM([]byte(ident.ServingCAPEM))
		require.NoError(t, err)
		require.True(t, servingCA.Equal(cp.servingCA.Cert))
		nodeCA, err := pki.ParseCertPEM([]byte(ident.NodeCAPEM))
		require.NoError(t, err)
		require.True(t, nodeCA.Equal(cp.nodeCA.Cert))
	}
	_, uses := cp.join.stats()
	require.Equal(t, 3, uses)
	require.Len(t, cp.join.claims, 3)
	require.Equal(t, "hgx-h100", cp.join.claims[0].GetVariant())
	require.NotEmpty(t, cp.join.claims[0].GetMachineId())

	node := r.Machines()[0].NodeID()
	// Heartbeats flow.
	require.Eventually(t, func() bool {
		for _, m := range cp.gw.received(node) {
			if m.GetHeartbeat().GetSeq() >= 2 {
				return true
			}
		}
		return false
	}, waitFor, tick)

	// diag.nvml runs: RUNNING, then SUCCEEDED with 8 GPUs.
	cmdID := ids.New(ids.Command, clock.New().Now())
	cp.gw.send(t, node, command(cmdID, "diag.nvml"))
	require.Eventually(t, func() bool { return len(cp.gw.updates(node, cmdID)) == 2 }, waitFor, tick)
	u := cp.gw.updates(node, cmdID)
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_RUNNING, u[0].GetState())
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, u[1].GetState())
	require.Len(t, u[1].GetResult().GetInventory().GetGpus(), 8)
	// Commands are appended to the journal; no other file appears.
	require.ElementsMatch(t, []string{agent.NodeFile, agent.JournalFile}, dirNames(t, r.Machines()[0].Dir()))

	// Desired state: bound, then observed.
	cp.gw.send(t, node, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_DesiredState{DesiredState: &gatewayv1.DesiredState{
		Generation: 1,
		Spec:       &gatewayv1.NodeSpec{Allocations: []*gatewayv1.Allocation{{ReservationId: "res_1", DeviceIndexes: []int32{0, 1}}}},
	}}})
	require.Eventually(t, func() bool { return r.Machines()[0].Status().ObservedGeneration == 1 }, waitFor, tick)
	require.Eventually(t, func() bool {
		var bound, observed bool
		for _, m := range cp.gw.received(node) {
			if b := m.GetReport().GetAllocationBound(); b != nil {
				bound = b.GetReservationId() == "res_1" && strings.Join(b.GetCdiDevices(), ",") == "nvidia.com/gpu=0,nvidia.com/gpu=1"
			}
			if m.GetReport().GetObservedGeneration() == 1 {
				observed = bound
			}
		}
		return observed
	}, waitFor, tick)

	// The health endpoint says ok.
	rec := httptest.NewRecorder()
	r.HealthHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	require.Equal(t, http.StatusOK, rec.Code)
}

func TestRestartReusesIdentityAndJournal(t *testing.T) {
	cp := newControlPlane(t, 1)
	dir := t.TempDir()
	cfg := cp.config(dir, 1)
	ctx, cancel := context.WithCancel(t.Context())
	r, err := startRunner(ctx, cfg, agent.Deps{Hardware: fakeHardware("l40s", nil)})
	require.NoError(t, err)
	waitEstablished(t, r)
	first := r.Machines()[0].Status()
	cmdID := ids.New(ids.Command, clock.New().Now())
	cp.gw.send(t, first.NodeID, command(cmdID, "logs.collect"))
	require.Eventually(t, func() bool { return len(cp.gw.updates(first.NodeID, cmdID)) == 2 }, waitFor, tick)
	cancel()
	require.NoError(t, r.Wait())
	nodeFile := filepath.Join(r.Machines()[0].Dir(), agent.NodeFile)
	ident, err := os.ReadFile(nodeFile)
	require.NoError(t, err)
	require.NoFileExists(t, filepath.Join(r.Machines()[0].Dir(), agent.BootFile), "the start that joins is boot 0")

	// Second run: the token has no uses left, yet no Join is needed.
	// Asked for cpu, the hardware is the l40s the machine joined as: the
	// identity gives its variant (agent.HardwareSpec.Variant).
	r2, _ := start(t, cfg, agent.Deps{Hardware: fakeHardware("cpu", nil)})
	waitEstablished(t, r2)
	second := r2.Machines()[0].Status()
	again, err := os.ReadFile(nodeFile)
	require.NoError(t, err)
	require.Equal(t, string(ident), string(again), "the identity is never rewritten")
	boot, err := os.ReadFile(filepath.Join(r2.Machines()[0].Dir(), agent.BootFile))
	require.NoError(t, err)
	require.Equal(t, "1\n", string(boot))
	require.Equal(t, first.NodeID, second.NodeID)
	require.Equal(t, first.MachineID, second.MachineID)
	require.Equal(t, "l40s", second.Variant)
	require.NotEqual(t, first.BootID, second.BootID, "a process start is a boot")
	calls, uses := cp.join.stats()
	require.Equal(t, 1, calls)
	require.Equal(t, 1, uses)

	hellos := cp.gw.helloes(first.NodeID)
	require.Len(t, hellos, 2)
	require.Len(t, hellos[1].GetJournal(), 1)
	require.Equal(t, cmdID, hellos[1].GetJournal()[0].GetCommandId())

	// The command, redelivered, is answered from the journal: SUCCEEDED, no
	// new RUNNING.
	cp.gw.send(t, first.NodeID, command(cmdID, "logs.collect"))
	require.Eventually(t, func() bool { return len(cp.gw.updates(first.NodeID, cmdID)) == 3 }, waitFor, tick)
	u := cp.gw.updates(first.NodeID, cmdID)
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, u[2].GetState())
	require.Equal(t, u[1].GetResult().GetOutput(), u[2].GetResult().GetOutput())
}

func TestJournalLossFailsUnsafeCommands(t *testing.T) {
	cp := newControlPlane(t, 1)
	dir := t.TempDir()
	cfg := cp.config(dir, 1)
	ctx, cancel := context.WithCancel(t.Context())
	r, err := startRunner(ctx, cfg, agent.Deps{})
	require.NoError(t, err)
	waitEstablished(t, r)
	node := r.Machines()[0].NodeID()
	cmdID := ids.New(ids.Command, clock.New().Now())
	cp.gw.send(t, node, command(cmdID, "logs.collect"))
	require.Eventually(t, func() bool { return len(cp.gw.updates(node, cmdID)) == 2 }, waitFor, tick)
	cancel()
	require.NoError(t, r.Wait())

	require.NoError(t, os.Remove(filepath.Join(r.Machines()[0].Dir(), agent.JournalFile)))
	r2, _ := start(t, cfg, agent.Deps{})
	waitEstablished(t, r2)
	cp.gw.send(t, node, command(cmdID, "logs.collect"))
	require.Eventually(t, func() bool { return len(cp.gw.updates(node, cmdID)) == 3 }, waitFor, tick)
	u := cp.gw.updates(node, cmdID)[2]
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_FAILED, u.GetState())
	require.Equal(t, daemon.ErrTextJournalLost, u.GetError())
}

// The journal made at Join is expected from then on: losing it before any
// command arrived is still detected, and a restart that lost nothing runs
// commands made before it.
func TestJournalLossBeforeAnyCommand(t *testing.T) {
	for _, lose := range []bool{false, true} {
		t.Run(fmt.Sprintf("lost=%v", lose), func(t *testing.T) {
			cp := newControlPlane(t, 1)
			cfg := cp.config(t.TempDir(), 1)
			ctx, cancel := context.WithCancel(t.Context())
			r, err := startRunner(ctx, cfg, agent.Deps{})
			require.NoError(t, err)
			waitEstablished(t, r)
			node := r.Machines()[0].NodeID()
			cancel()
			require.NoError(t, r.Wait())
			cmdID := ids.New(ids.Command, clock.New().Now()) // made before the restart
			if lose {
				require.NoError(t, os.Remove(filepath.Join(r.Machines()[0].Dir(), agent.JournalFile)))
			}

			r2, _ := start(t, cfg, agent.Deps{})
			waitEstablished(t, r2)
			cp.gw.send(t, node, command(cmdID, "logs.collect"))
			if lose {
				require.Eventually(t, func() bool { return len(cp.gw.updates(node, cmdID)) == 1 }, waitFor, tick)
				u := cp.gw.updates(node, cmdID)[0]
				require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_FAILED, u.GetState())
				require.Equal(t, daemon.ErrTextJournalLost, u.GetError())
				epoch, err := os.ReadFile(filepath.Join(r2.Machines()[0].Dir(), agent.JournalEpochFile))
				require.NoError(t, err)
				require.Equal(t, "2\n", string(epoch))
				return
			}
			require.Eventually(t, func() bool { return len(cp.gw.updates(node, cmdID)) == 2 }, waitFor, tick)
			require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, cp.gw.updates(node, cmdID)[1].GetState())
			require.NoFileExists(t, filepath.Join(r2.Machines()[0].Dir(), agent.JournalEpochFile))
		})
	}
}

func TestRebootAndReconnect(t *testing.T) {
	cp := newControlPlane(t, 1)
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	m := r.Machines()[0]
	node := m.NodeID()
	boot := m.Status().BootID

	// The gateway drops the session: the machine reconnects.
	cp.gw.kick(t, node)
	require.Eventually(t, func() bool { return len(cp.gw.helloes(node)) == 2 && m.State() == daemon.StateEstablished }, waitFor, tick)
	require.Equal(t, boot, cp.gw.helloes(node)[1].GetBootId())

	// node.reboot: SUCCEEDED, then back with a new boot id.
	cmdID := ids.New(ids.Command, clock.New().Now())
	cp.gw.send(t, node, command(cmdID, "node.reboot"))
	require.Eventually(t, func() bool { return len(cp.gw.helloes(node)) == 3 && m.State() == daemon.StateEstablished }, waitFor, tick)
	u := cp.gw.updates(node, cmdID)
	require.Len(t, u, 2)
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, u[1].GetState())
	newBoot := cp.gw.helloes(node)[2].GetBootId()
	require.NotEqual(t, boot, newBoot)
	require.Equal(t, newBoot, m.Status().BootID)
	require.Equal(t, 3, m.Status().Sessions)
	b, err := os.ReadFile(filepath.Join(m.Dir(), agent.BootFile))
	require.NoError(t, err)
	require.Equal(t, "1\n", string(b), "the reboot is persisted")
}

// TestLostGatewayConnection: a session whose connection drops (the gateway
// was killed) ends as unavailable, "lost the connection to the gateway",
// not as connect-go's "internal: protocol error: incomplete envelope", and
// the machine reconnects.
func TestLostGatewayConnection(t *testing.T) {
	cp := newControlPlane(t, 1)
	var logs syncBuffer
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	waitEstablished(t, r)
	m := r.Machines()[0]
	node := m.NodeID()

	cp.gwServer.CloseClientConnections()
	require.Eventually(t, func() bool { return len(cp.gw.helloes(node)) == 2 && m.State() == daemon.StateEstablished },
		waitFor, tick, "the machine reconnects (logs %s)", logs.String())
	var ended []string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `msg="session ended"`) {
			ended = append(ended, l)
		}
	}
	require.Len(t, ended, 1, logs.String())
	require.Contains(t, ended[0], `err="unavailable: lost the connection to the gateway: `)
}

// A crash while saving the identity leaves only a temporary file: the next
// start joins afresh.
func TestTornIdentityJoinsAgain(t *testing.T) {
	cp := newControlPlane(t, 1)
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "0"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "0", ".tmp-"+agent.NodeFile+"123"), []byte(`{"node_id":"node_x",`), 0o600))
	r, _ := start(t, cp.config(dir, 1), agent.Deps{})
	waitEstablished(t, r)
	require.NotEqual(t, "node_x", r.Machines()[0].NodeID())
	calls, uses := cp.join.stats()
	require.Equal(t, 1, calls)
	require.Equal(t, 1, uses)
}

// A machine stopped while its Join was in flight (no answer came) joins
// again with the same key and machine id, so that JoinService answers with
// the node that key joined as instead of making another; the pending key
// goes once the identity is saved.
func TestStoppedMidJoinJoinsAgainWithTheSameKey(t *testing.T) {
	cp := newControlPlane(t, 2)
	cp.join.hangFirst = true
	dir := t.TempDir()
	r, err := newRunner(cp.config(dir, 1), agent.Deps{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	require.Eventually(t, func() bool { calls, _ := cp.join.stats(); return calls == 1 }, 10*time.Second, 5*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	pending := filepath.Join(dir, "0", agent.PendingJoinFile)
	require.FileExists(t, pending)
	st, err := os.Stat(pending)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "it holds the private key")

	r2, _ := start(t, cp.config(dir, 1), agent.Deps{})
	waitEstablished(t, r2)
	cp.join.mu.Lock()
	reqs, claims := slices.Clone(cp.join.requests), slices.Clone(cp.join.claims)
	cp.join.mu.Unlock()
	require.Len(t, reqs, 2)
	key := func(r *joinv1.JoinRequest) []byte {
		csr, err := pki.ParseCSR(r.GetCsrDer())
		require.NoError(t, err)
		return csr.RawSubjectPublicKeyInfo
	}
	require.Equal(t, key(reqs[0]), key(reqs[1]), "the same key")
	require.Equal(t, reqs[0].GetClaims().GetMachineId(), claims[0].GetMachineId(), "the same machine")
	require.NoFileExists(t, pending)
	require.Equal(t, reqs[0].GetClaims().GetMachineId(), r2.Machines()[0].Status().MachineID)
}

func TestJoinRefused(t *testing.T) {
	for _, tc := range []struct {
		name, token string
		maxUses     int
		want        string
		code        connect.Code
	}{
		{"used up", goodToken, 0, "join refused: join token is used up (0 of 0 uses)", connect.CodeFailedPrecondition},
		{"invalid", "bcjt_wrong_token", 5, "join refused: join token is invalid", connect.CodePermissionDenied},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cp := newControlPlane(t, tc.maxUses)
			cfg := cp.config(t.TempDir(), 2)
			cfg.Token = tc.token
			r, err := newRunner(cfg, agent.Deps{})
			require.NoError(t, err)
			err = r.Run(t.Context())
			require.EqualError(t, err, tc.want)
			var refused *agent.JoinRefusedError
			require.ErrorAs(t, err, &refused)
			require.Equal(t, tc.code, refused.Code)
			require.Error(t, r.Ready())
		})
	}
}

func TestJoinRetriesTransientErrors(t *testing.T) {
	cp := newControlPlane(t, 1)
	cp.join.failFirst = 3
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	calls, uses := cp.join.stats()
	require.Equal(t, 4, calls)
	require.Equal(t, 1, uses)
}

func TestServerNameFromURLHost(t *testing.T) {
	cp := newControlPlane(t, 1)
	cp.join.serverName = "" // verify 127.0.0.1 from the URL
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{Logger: testLogger(t)})
	waitEstablished(t, r)
}

func TestGatewayServerNameMismatchNeverEstablishes(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	cfg.GatewayServerName = "gateway.elsewhere"
	r, _ := start(t, cfg, agent.Deps{})
	require.Eventually(t, func() bool { return r.Ready() == nil }, waitFor, tick)
	// The TLS check fails, so the machine keeps backing off.
	require.Eventually(t, func() bool { return r.Machines()[0].State() == daemon.StateBackoff }, waitFor, tick)
	require.Empty(t, cp.gw.helloes(r.Machines()[0].NodeID()))
}

func TestTokenFileWait(t *testing.T) {
	cp := newControlPlane(t, 1)
	clk := clock.NewFake(clock.New().Now())
	dir := t.TempDir()
	cfg := cp.config(filepath.Join(dir, "data"), 1)
	cfg.Token = ""
	cfg.TokenFile = filepath.Join(dir, "token")
	cfg.TokenWait = time.Minute
	r, _ := start(t, cfg, agent.Deps{Clock: clk})
	// Waiting: nothing joins while the file is missing.
	clk.Advance(time.Second)
	calls, _ := cp.join.stats()
	require.Zero(t, calls)
	require.Error(t, r.Ready())
	require.NoError(t, os.WriteFile(cfg.TokenFile, []byte(goodToken+"\n"), 0o600))
	require.Eventually(t, func() bool {
		clk.Advance(250 * time.Millisecond)
		return r.Ready() == nil
	}, waitFor, tick)
	waitEstablished(t, r)
}

func TestTokenFileNeverAppears(t *testing.T) {
	cp := newControlPlane(t, 1)
	clk := clock.NewFake(clock.New().Now())
	dir := t.TempDir()
	cfg := cp.config(filepath.Join(dir, "data"), 1)
	cfg.Token = ""
	cfg.TokenFile = filepath.Join(dir, "token")
	cfg.TokenWait = 5 * time.Second
	r, _ := start(t, cfg, agent.Deps{Clock: clk})
	require.Eventually(t, func() bool {
		clk.Advance(time.Second)
		select {
		case <-r.Done():
			return true
		default:
			return false
		}
	}, waitFor, tick)
	require.ErrorContains(t, r.Wait(), "did not appear within 5s")
}

func TestNoToken(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	cfg.Token = ""
	r, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	require.ErrorContains(t, r.Run(t.Context()), "no join token")
}

// TestNewValidates; an unknown variant is the fake hardware's
// (services/fakedaemon's TestNewValidatesVariant).
func TestNewValidates(t *testing.T) {
	_, err := newRunner(agent.Config{Nodes: -1}, agent.Deps{})
	require.ErrorContains(t, err, "nodes must be from 1 to 20000")
	// A malformed gateway override is refused up front, not at each
	// machine's first session.
	_, err = newRunner(agent.Config{GatewayURL: "gateway:8443"}, agent.Deps{})
	require.ErrorContains(t, err, `gateway url override (--gateway-url): gateway URL "gateway:8443" must be https://HOST[:PORT]`)
	_, err = newRunner(agent.Config{GatewayURL: "https://gw-a:8443,https://"}, agent.Deps{})
	require.ErrorContains(t, err, `gateway URL "https://" has no host`)
	ok := agent.Config{DataDir: t.TempDir(), AgentVersion: testVersion}
	_, err = newRunner(ok, agent.Deps{})
	require.NoError(t, err)
	noDir := ok
	noDir.DataDir = ""
	_, err = newRunner(noDir, agent.Deps{})
	require.EqualError(t, err, "a data directory is required (--data-dir)")
	noVersion := ok
	noVersion.AgentVersion = ""
	_, err = newRunner(noVersion, agent.Deps{})
	require.EqualError(t, err, "an agent version is required")
	_, err = agent.New(ok, agent.Deps{})
	require.EqualError(t, err, "no hardware (Deps.Hardware)")
}

func TestHealthServer(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r, _ := start(t, cfg, agent.Deps{HealthListener: ln})
	waitEstablished(t, r)
	url := "http://" + ln.Addr().String() + "/healthz"
	require.Eventually(t, func() bool { return service.Healthcheck(url) == 0 }, waitFor, tick)
}

func TestDataDirInUse(t *testing.T) {
	cp := newControlPlane(t, 2)
	dir := t.TempDir()
	r, _ := start(t, cp.config(dir, 1), agent.Deps{})
	waitEstablished(t, r)
	r2, err := newRunner(cp.config(dir, 1), agent.Deps{})
	require.NoError(t, err)
	require.ErrorContains(t, r2.Run(t.Context()), "is in use by another agent process (give each its own --data-dir)")
	_, uses := cp.join.stats()
	require.Equal(t, 1, uses)
}

// TestJoinSealsTokenAndStoresTrust: the token travels only sealed, bound to
// the CSR, and with signed intent the identity keeps the command-signing
// root, which a restart reads back.
func TestJoinSealsTokenAndStoresTrust(t *testing.T) {
	cp := newControlPlane(t, 1)
	cp.join.signedIntent = true
	cfg := cp.config(t.TempDir(), 1)
	ctx, cancel := context.WithCancel(t.Context())
	r, err := startRunner(ctx, cfg, agent.Deps{})
	require.NoError(t, err)
	waitEstablished(t, r)
	cancel()
	require.NoError(t, r.Wait())

	require.Len(t, cp.join.requests, 1)
	req := cp.join.requests[0]
	raw, err := proto.Marshal(req)
	require.NoError(t, err)
	require.NotContains(t, string(raw), goodToken, "the token is never sent in clear")
	_, err = pki.OpenJoinToken(cp.join.joinKey, req.GetSealedToken(), newCSRFor(t))
	require.ErrorIs(t, err, pki.ErrSealOpen, "the seal is bound to the machine's CSR")

	b, err := os.ReadFile(filepath.Join(r.Machines()[0].Dir(), agent.NodeFile))
	require.NoError(t, err)
	var ident agent.Identity
	require.NoError(t, json.Unmarshal(b, &ident))
	require.Equal(t, cp.join.commandRoot, ident.CommandSigningRoot)

	// A restart reads the root back (a broken one is refused: see
	// TestBrokenCommandSigningRootInIdentityIsRefused) and joins no more.
	r2, _ := start(t, cfg, agent.Deps{})
	waitEstablished(t, r2)
	require.Equal(t, 1, cp.join.uses)
}

func TestBrokenCommandSigningRootInIdentityIsRefused(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	ctx, cancel := context.WithCancel(t.Context())
	r, err := startRunner(ctx, cfg, agent.Deps{})
	require.NoError(t, err)
	waitEstablished(t, r)
	cancel()
	require.NoError(t, r.Wait())
	path := filepath.Join(r.Machines()[0].Dir(), agent.NodeFile)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc map[string]any
	require.NoError(t, json.Unmarshal(b, &doc))
	doc["command_signing_root"] = "bm90IGEga2V5" // base64 of "not a key"
	b, err = json.Marshal(doc)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, b, 0o600))
	r2, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	require.ErrorContains(t, r2.Run(t.Context()), "command_signing_root")
}

func newCSRFor(t *testing.T) []byte {
	t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, "other")
	require.NoError(t, err)
	return csr
}

// TestUntrustedJoinResponseIsRefused is the daemon's half of the bad joins:
// a JoinResponse it cannot trust stops the machine with the reason, and
// nothing of it is kept.
func TestUntrustedJoinResponseIsRefused(t *testing.T) {
	otherCA, err := pki.NewCA("another serving CA", clock.New().Now(), time.Hour)
	require.NoError(t, err)
	otherSigner, err := pki.GenerateSigningKey()
	require.NoError(t, err)
	otherRoot, err := x509.MarshalPKIXPublicKey(otherSigner.Public())
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		setup func(j *fakeJoin)
		want  string
	}{
		{"bad signature", func(j *fakeJoin) {
			j.tamper = func(r *joinv1.JoinResponse) { r.Signature[3] ^= 0x10 }
		}, "its signature does not verify with the pinned join signing key"},
		{"unsigned", func(j *fakeJoin) {
			j.tamper = func(r *joinv1.JoinResponse) { r.Signature = nil }
		}, "it is not signed"},
		{"changed after signing", func(j *fakeJoin) {
			j.tamper = func(r *joinv1.JoinResponse) { r.GatewayUrls = []string{"https://elsewhere.example:8443"} }
		}, "its signature does not verify"},
		{"signed by another key than the pinned one", func(j *fakeJoin) {
			j.signWith = otherSigner
		}, "its signature does not verify with the pinned join signing key"},
		{"document naming a signing key not matching the pin", func(j *fakeJoin) {
			j.signKey = otherSigner // the document names it and it signs: both agree, the pin does not
		}, "does not match the join signing pin"},
		{"serving CA not matching its pin", func(j *fakeJoin) {
			j.edit = func(r *joinv1.JoinResponse) { r.ServingCaDer = otherCA.Cert.Raw }
		}, "serving_ca_der"},
		{"command-signing root not matching its pin", func(j *fakeJoin) {
			j.edit = func(r *joinv1.JoinResponse) { r.Trust = &joinv1.Trust{CommandSigningRoot: otherRoot} }
		}, "trust.command_signing_root"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cp := newControlPlane(t, 1)
			tc.setup(cp.join)
			r, err := newRunner(cp.config(t.TempDir(), 1), agent.Deps{})
			require.NoError(t, err)
			err = r.Run(t.Context())
			require.ErrorContains(t, err, tc.want)
			require.Error(t, r.Ready())
			require.NoFileExists(t, filepath.Join(r.Machines()[0].Dir(), agent.NodeFile))
			require.Empty(t, cp.gw.helloes(r.Machines()[0].NodeID()))
		})
	}
}

// TestJoinNeedsTrustedKeys: without pins, or with a well-known document
// whose keys do not match them, the machine never calls Join.
func TestJoinNeedsTrustedKeys(t *testing.T) {
	other, err := pki.GenerateJoinEncryptionKey()
	require.NoError(t, err)
	otherEnc, err := x509.MarshalPKIXPublicKey(other.PublicKey())
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		edit func(cp *controlPlane, cfg *agent.Config)
		want string
	}{
		{"no pins", func(_ *controlPlane, cfg *agent.Config) { cfg.Pins = pki.Pins{} },
			"refusing to join a deployment it cannot authenticate: no pins for --serving-ca-pin, --join-signing-pin, --join-encryption-pin"},
		{"no serving CA pin", func(_ *controlPlane, cfg *agent.Config) { cfg.Pins.ServingCA = "" },
			"no pins for --serving-ca-pin"},
		{"document's encryption key not matching its pin", func(cp *controlPlane, _ *agent.Config) {
			cp.join.editDoc = func(d *pki.WellKnown) { d.JoinEncryptionKey = otherEnc }
		}, "does not match the join encryption pin"},
		{"document's serving CA not matching its pin", func(cp *controlPlane, cfg *agent.Config) {
			cfg.Pins.ServingCA = pki.PinOfSPKI(otherEnc)
		}, "well-known document: servingCa"},
		{"no join keys without a server", func(cp *controlPlane, cfg *agent.Config) {
			cfg.Server, cfg.JoinURL = "", cp.joinURL
		}, "no join keys: set --server"},
		// The command-signing pin is checked before Join too: a wrong one
		// spends no join token and leaves no node behind.
		{"wrong command-signing pin", func(_ *controlPlane, cfg *agent.Config) {
			cfg.Pins.CommandSigning = pki.PinOfSPKI(otherEnc)
		}, "well-known document: commandSigningKey: the command-signing key"},
		{"command-signing pin and a document without the key", func(cp *controlPlane, _ *agent.Config) {
			cp.join.editDoc = func(d *pki.WellKnown) { d.CommandSigningKey = nil }
		}, "no command-signing key to check the command signing pin"},
		{"keys given directly and a wrong command-signing pin", func(cp *controlPlane, cfg *agent.Config) {
			doc := cp.join.wellKnown(cp.joinURL)
			cfg.Server, cfg.JoinURL = "", cp.joinURL
			cfg.JoinEncryptionKey, cfg.JoinSigningKey, cfg.CommandSigningKey = doc.JoinEncryptionKey, doc.JoinSigningKey, doc.CommandSigningKey
			cfg.Pins.CommandSigning = pki.PinOfSPKI(otherEnc)
		}, "the command-signing key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cp := newControlPlane(t, 1)
			cfg := cp.config(t.TempDir(), 1)
			tc.edit(cp, &cfg)
			r, err := newRunner(cfg, agent.Deps{})
			require.NoError(t, err)
			require.ErrorContains(t, r.Run(t.Context()), tc.want)
			calls, _ := cp.join.stats()
			require.Zero(t, calls)
		})
	}
}

// TestJoinWithKeysInsteadOfServer joins with the keys given directly (as
// --join-keys-dir does), at JoinURL.
func TestJoinWithKeysInsteadOfServer(t *testing.T) {
	cp := newControlPlane(t, 1)
	doc := cp.join.wellKnown(cp.joinURL)
	cfg := cp.config(t.TempDir(), 1)
	cfg.Server, cfg.JoinURL = "", cp.joinURL
	cfg.JoinEncryptionKey, cfg.JoinSigningKey, cfg.CommandSigningKey = doc.JoinEncryptionKey, doc.JoinSigningKey, doc.CommandSigningKey
	r, _ := start(t, cfg, agent.Deps{})
	waitEstablished(t, r)
}

// TestInsecureTrustServerPins joins with no pins but the escape hatch: the
// document's own pins are taken.
func TestInsecureTrustServerPins(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	cfg.Pins, cfg.InsecureTrustServerPins = pki.Pins{}, true
	r, _ := start(t, cfg, agent.Deps{})
	waitEstablished(t, r)
	_, err := newRunner(agent.Config{InsecureTrustServerPins: true}, agent.Deps{})
	require.ErrorContains(t, err, "needs a server")
}

// TestJoinOnly joins every machine and returns without sessions; a second
// run has nothing to do and is no boot.
func TestJoinOnly(t *testing.T) {
	cp := newControlPlane(t, 2)
	cfg := cp.config(t.TempDir(), 2)
	cfg.JoinOnly = true
	cfg.HealthListen = ":1" // ignored: joining only serves no health endpoint
	r, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	require.NoError(t, r.Run(t.Context()))
	require.NoError(t, r.Ready())
	for _, m := range r.Machines() {
		require.NotEmpty(t, m.NodeID())
		require.ElementsMatch(t, []string{agent.NodeFile, agent.JournalFile}, dirNames(t, m.Dir()))
		require.Empty(t, cp.gw.helloes(m.NodeID()), "no session")
	}
	r2, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	require.NoError(t, r2.Run(t.Context()))
	require.Equal(t, r.Machines()[1].NodeID(), r2.Machines()[1].NodeID())
	require.NoFileExists(t, filepath.Join(r2.Machines()[0].Dir(), agent.BootFile))
	calls, uses := cp.join.stats()
	require.Equal(t, 2, calls)
	require.Equal(t, 2, uses)
}

// TestJoinsReuseConnections: the machines of one Runner share the
// connections of their Joins (and the well-known document's fetch): no more
// are opened than the Joins in flight at once (Config.JoinConcurrency), not
// one per Join, each a TCP (and with https a TLS) handshake on both sides.
func TestJoinsReuseConnections(t *testing.T) {
	const machines, inFlight = 64, 16
	cp := newControlPlane(t, machines)
	cfg := cp.config(t.TempDir(), machines)
	cfg.JoinOnly = true
	cfg.JoinConcurrency = inFlight
	cp.join.together = inFlight
	r, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	require.NoError(t, r.Run(t.Context()))
	require.NoError(t, r.Ready())
	calls, _ := cp.join.stats()
	require.Equal(t, machines, calls)
	t.Logf("connections: %d", cp.joinConns.Load())
	require.LessOrEqual(t, cp.joinConns.Load(), int64(inFlight))
}

func TestNewRefusesMalformedPins(t *testing.T) {
	_, err := newRunner(agent.Config{Pins: pki.Pins{JoinSigning: "sha256/short"}}, agent.Deps{})
	require.ErrorContains(t, err, "pins: joinSigning")
}

// TestRevokedMachineStopsForGood: a machine whose node is revoked stops
// (no reconnect loop), says it must join again, and makes the health
// endpoint unhealthy, while the other machines go on; a restart with the
// revoked identity is refused once and stops again.
func TestRevokedMachineStopsForGood(t *testing.T) {
	cp := newControlPlane(t, 2)
	dir := t.TempDir()
	cfg := cp.config(dir, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var logs syncBuffer
	r, cancel := start(t, cfg, agent.Deps{HealthListener: ln, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	waitEstablished(t, r)
	url := "http://" + ln.Addr().String() + "/healthz"
	require.Eventually(t, func() bool { return service.Healthcheck(url) == 0 }, waitFor, tick)

	revoked, other := r.Machines()[0], r.Machines()[1]
	cp.gw.revoke(t, revoked.NodeID())
	require.Eventually(t, func() bool { return revoked.State() == daemon.StateStopped }, waitFor, tick)
	st := revoked.Status()
	require.Contains(t, st.Stopped, "node "+st.NodeID+" was revoked")
	require.Contains(t, st.Stopped, "must join again")
	require.ErrorContains(t, r.Ready(), "machine 0 (node "+st.NodeID+") stopped for good")
	require.Eventually(t, func() bool { return service.Healthcheck(url) != 0 }, waitFor, tick)
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "must join again")
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "stopped for good") {
			require.LessOrEqual(t, strings.Count(l, "node.id="), 1, "a log line names its node once: %s", l)
		}
	}

	// No reconnect loop: many backoff periods (100 ms max) later, the
	// revoked machine has not dialled again; the other one is untouched.
	require.Never(t, func() bool { return len(cp.gw.helloes(st.NodeID)) > 1 || cp.gw.refusals(st.NodeID) > 0 },
		500*time.Millisecond, tick, "no reconnect")
	require.Equal(t, daemon.StateEstablished, other.State())
	select {
	case <-r.Done():
		t.Fatal("the runner must keep running (health endpoint, other machines)")
	default:
	}
	cancel()
	require.NoError(t, r.Wait())

	// A restart dials once with the revoked identity, is refused, and stops.
	r2, _ := start(t, cfg, agent.Deps{})
	require.Eventually(t, func() bool { return r2.Machines()[0].State() == daemon.StateStopped }, waitFor, tick)
	require.Never(t, func() bool { return cp.gw.refusals(st.NodeID) > 1 }, 300*time.Millisecond, tick, "refused once, then stopped")
	require.Equal(t, 1, cp.gw.refusals(st.NodeID))
	require.Error(t, r2.Ready())
	_, uses := cp.join.stats()
	require.Equal(t, 2, uses, "it does not join again by itself")
}

// TestExpiredCertificateStopsBeforeDialling: a machine whose certificate
// expired while it was offline never dials (no "tls: expired certificate"
// loop): it stops for good, saying when the certificate expired.
func TestExpiredCertificateStopsBeforeDialling(t *testing.T) {
	cp := newControlPlane(t, 1)
	dir := t.TempDir()
	cfg := cp.config(dir, 1)
	cfg.JoinOnly = true
	r, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	require.NoError(t, r.Run(t.Context()))
	notAfter := r.Machines()[0].Status().CertNotAfter
	require.False(t, notAfter.IsZero())

	// Two hours later (the fake JoinService issues 1 h certificates).
	cfg.JoinOnly = false
	clk := clock.NewFake(clock.New().Now().Add(2 * time.Hour))
	r2, _ := start(t, cfg, agent.Deps{Clock: clk})
	m := r2.Machines()[0]
	require.Eventually(t, func() bool { return m.State() == daemon.StateStopped }, waitFor, tick)
	require.Contains(t, m.Status().Stopped, "node certificate expired at "+notAfter.UTC().Format(time.RFC3339)+"; join again")
	require.ErrorContains(t, r2.Ready(), "stopped for good")
	require.Empty(t, cp.gw.helloes(m.NodeID()), "never dialled")
}

// syncBuffer is syncbuf.Buffer: safe for concurrent writers and readers.
type syncBuffer = syncbuf.Buffer

// TestJoinOnlyReportsEachMachine: joining 3 machines with a 2-use token joins
// 2 (their ids are kept) and reports the third's refusal, without the
// refusal cancelling the others.
func TestJoinOnlyReportsEachMachine(t *testing.T) {
	cp := newControlPlane(t, 2)
	cfg := cp.config(t.TempDir(), 3)
	cfg.JoinOnly = true
	cfg.JoinConcurrency = 1 // one at a time: the last to join is refused, whichever it is
	r, err := newRunner(cfg, agent.Deps{})
	require.NoError(t, err)
	err = r.Run(t.Context())
	require.Error(t, err)
	require.Regexp(t, `^1 of 3 machines could not join: machine [0-2]: join refused: join token is used up \(2 of 2 uses\)$`, err.Error())
	var refused *agent.JoinRefusedError
	require.ErrorAs(t, err, &refused)
	var joined, failed int
	for _, m := range r.Machines() {
		st := m.Status()
		if st.Joined {
			joined++
			require.NotEmpty(t, st.NodeID)
			require.Empty(t, st.JoinError)
		} else {
			failed++
			require.Equal(t, "join refused: join token is used up (2 of 2 uses)", st.JoinError)
		}
	}
	require.Equal(t, 2, joined)
	require.Equal(t, 1, failed)
}

// TestTokenFileEmpty: a token file that stays empty is reported as empty,
// not as missing.
func TestTokenFileEmpty(t *testing.T) {
	cp := newControlPlane(t, 1)
	clk := clock.NewFake(clock.New().Now())
	dir := t.TempDir()
	cfg := cp.config(filepath.Join(dir, "data"), 1)
	cfg.Token = ""
	cfg.TokenFile = filepath.Join(dir, "token")
	cfg.TokenWait = 3 * time.Second
	require.NoError(t, os.WriteFile(cfg.TokenFile, []byte("\n"), 0o600))
	r, _ := start(t, cfg, agent.Deps{Clock: clk})
	require.Eventually(t, func() bool {
		clk.Advance(time.Second)
		select {
		case <-r.Done():
			return true
		default:
			return false
		}
	}, waitFor, tick)
	require.EqualError(t, r.Wait(), "no join token: "+cfg.TokenFile+" is empty (waited 3s for a token in it)")
}

// TestHardwareSpec: the agent makes each machine's Hardware at each start
// from what its directory says: nothing on the first start (boot 0), the
// machine id of a Join that did not complete, then the identity's machine
// id and variant with the boot counter; joining only is no boot.
func TestHardwareSpec(t *testing.T) {
	cp := newControlPlane(t, 2)
	cp.join.hangFirst = true
	dir := t.TempDir()
	var mu sync.Mutex
	var specs []agent.HardwareSpec
	deps := agent.Deps{Hardware: func(spec agent.HardwareSpec) (agent.Hardware, error) {
		if spec.Logger == nil {
			return nil, errors.New("no logger in the spec")
		}
		spec.Logger = nil
		mu.Lock()
		specs = append(specs, spec)
		mu.Unlock()
		return fakeHardware(fakehw.VariantL40S, nil)(spec)
	}}
	last := func() agent.HardwareSpec {
		mu.Lock()
		defer mu.Unlock()
		return specs[len(specs)-1]
	}

	// Stopped mid-join: the first start knew nothing.
	r, err := newRunner(cp.config(dir, 1), deps)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	require.Eventually(t, func() bool { calls, _ := cp.join.stats(); return calls == 1 }, waitFor, tick)
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, agent.HardwareSpec{}, last())
	machineID := r.Machines()[0].Status().MachineID
	require.NotEmpty(t, machineID)

	// Joining again (only): the machine id of join.pending, boot 0.
	cfg := cp.config(dir, 1)
	cfg.JoinOnly = true
	r, err = newRunner(cfg, deps)
	require.NoError(t, err)
	require.NoError(t, r.Run(t.Context()))
	require.Equal(t, agent.HardwareSpec{MachineID: machineID}, last())

	// Each later start: the identity's machine id and variant, the next
	// boot.
	for boot := uint64(1); boot <= 2; boot++ {
		ctx, cancel := context.WithCancel(t.Context())
		r, err := startRunner(ctx, cp.config(dir, 1), deps)
		require.NoError(t, err)
		waitEstablished(t, r)
		cancel()
		require.NoError(t, r.Wait())
		require.Equal(t, agent.HardwareSpec{MachineID: machineID, Variant: fakehw.VariantL40S, Boot: boot}, last())
	}
}

// TestSessionTransports: sessions go over the framed transport by default
// (a gateway that serves it), over Connect when configured so, and over
// Connect to a gateway that refuses the framed transport, whose refusal
// costs one handshake: the next sessions to it go over Connect at once.
func TestSessionTransports(t *testing.T) {
	t.Run("framed by default", func(t *testing.T) {
		cp := newControlPlane(t, 1)
		r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
		waitEstablished(t, r)
		require.Equal(t, 1, cp.gw.framedSessions())
	})
	t.Run("connect when configured", func(t *testing.T) {
		cp := newControlPlane(t, 1)
		cfg := cp.config(t.TempDir(), 1)
		cfg.SessionTransport = agent.SessionConnect
		r, _ := start(t, cfg, agent.Deps{})
		waitEstablished(t, r)
		require.Zero(t, cp.gw.framedSessions())
		require.Len(t, cp.gw.helloes(r.Machines()[0].NodeID()), 1)
	})
	t.Run("connect to a gateway without it", func(t *testing.T) {
		cp := newControlPlane(t, 1)
		old := newFakeGateway("gw-old")
		cfg := cp.config(t.TempDir(), 1)
		cfg.GatewayURL = cp.serveGatewayWith(old, false)
		var logs syncBuffer
		r, _ := start(t, cfg, agent.Deps{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		waitEstablished(t, r)
		node := r.Machines()[0].NodeID()
		old.kick(t, node)
		require.Eventually(t, func() bool { return len(old.helloes(node)) == 2 && r.Machines()[0].State() == daemon.StateEstablished },
			waitFor, tick, "the machine reconnects (logs %s)", logs.String())
		require.Equal(t, 1, strings.Count(logs.String(), "does not serve the framed session transport"), logs.String())
		require.Zero(t, old.framedSessions())
	})
	t.Run("an unknown transport", func(t *testing.T) {
		cp := newControlPlane(t, 1)
		cfg := cp.config(t.TempDir(), 1)
		cfg.SessionTransport = "quic"
		_, err := newRunner(cfg, agent.Deps{})
		require.ErrorContains(t, err, "session transport (--session-transport) must be framed or connect")
	})
}
