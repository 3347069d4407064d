package gateway_test

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/pkg/bus/bustest"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/outbox"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	if code == 0 && os.Getenv(benchClientEnv) == "" {
		if err := goleak.Find(
			// pgx's and testcontainers' process-wide helpers.
			goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
			goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
			goleak.IgnoreAnyFunction("go.opencensus.io/stats/view.(*worker).start"),
		); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// waitFor is how long a test waits for something that should happen
// promptly.
const waitFor = 15 * time.Second

// realClock measures test timeouts; the gateway may run on a fake one.
var realClock = clock.New()

// env is one gateway (or several) over a fresh database and an embedded NATS
// server, with a tenant, site and pool to put nodes in.
type env struct {
	t           testing.TB
	db          *store.DB
	clk         clock.Clock
	ns          *natsserver.Server
	nc          *nats.Conn
	pkiDir      string
	nodeCA      *pki.CA
	servingCAs  *x509.CertPool
	trustDomain string
	poolID      string
	tenantID    string
	// certs is the NodeCertService the gateways renew through
	// (startGateway's JoinServiceURL unless the test sets one).
	certs *nodeCerts
	// metrics, when set, is the metrics pipeline of the gateways
	// startGateway runs.
	metrics *telemetry.Metrics
}

// options tune setup.
type options struct {
	clock clock.Clock // real when nil
}

func setup(t testing.TB, o options) *env {
	t.Helper()
	clk := o.clock
	if clk == nil {
		clk = clock.New()
	}
	e := &env{t: t, clk: clk}
	e.db = storetest.New(t, clk)
	ns, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(ns.Shutdown)
	e.ns = ns
	e.nc = e.natsConn()

	e.pkiDir = t.TempDir()
	_, err = pki.Init(e.pkiDir, pki.InitOptions{}, realClock.Now())
	require.NoError(t, err)
	e.nodeCA, err = pki.LoadCA(filepath.Join(e.pkiDir, pki.NodeCACert), filepath.Join(e.pkiDir, pki.NodeCAKey))
	require.NoError(t, err)
	sca, err := pki.LoadCert(filepath.Join(e.pkiDir, pki.ServingCACert))
	require.NoError(t, err)
	e.servingCAs = x509.NewCertPool()
	e.servingCAs.AddCert(sca)
	e.trustDomain, err = pki.ReadTrustDomain(e.pkiDir)
	require.NoError(t, err)
	e.certs = e.startNodeCerts()

	e.tenantID = storetest.Tenant(t, e.db, &storetest.TenantOpts{Name: "acme"}).ID
	site := storetest.Site(t, e.db, &storetest.SiteOpts{Name: "dev-1"})
	e.poolID = storetest.Pool(t, e.db, &storetest.PoolOpts{SiteID: site.ID, OwnerTenantID: e.tenantID, Name: "metal"}).ID
	return e
}

func (e *env) natsConn() *nats.Conn {
	nc, err := nats.Connect(e.ns.ClientURL())
	require.NoError(e.t, err)
	e.t.Cleanup(nc.Close)
	return nc
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	_, err := e.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(e.t, err)
}

// gw is a running gateway.
type gw struct {
	srv  *gateway.Server
	addr string
	// controlURL is the control server's URL (http://127.0.0.1:PORT).
	controlURL string
	stop       func()
}

// requestTimeout is the gateways' HTTPRequestTimeout in tests, far below
// how long sessions and tunnels last in them: a stream that is not exempt
// from it (service.LongLived) breaks the tests.
const requestTimeout = 300 * time.Millisecond

// startGateway runs a gateway with cfg (its listener and PKI filled in; no
// probes server unless cfg has a HealthListener; HTTPRequestTimeout
// requestTimeout unless set) until the test ends.
func (e *env) startGateway(cfg gateway.Config) *gw {
	e.t.Helper()
	cfg.HTTPRequestTimeout = cmp.Or(cfg.HTTPRequestTimeout, requestTimeout)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(e.t, err)
	cfg.Listener = ln
	if cfg.ControlListener == nil {
		cfg.ControlListener, err = net.Listen("tcp", "127.0.0.1:0")
		require.NoError(e.t, err)
	}
	cfg.PKIDir = e.pkiDir
	if cfg.JoinServiceURL == "" {
		cfg.JoinServiceURL = e.certs.url
	}
	cfg.NoHealthServer = cfg.HealthListener == nil
	if cfg.GatewayID == "" {
		cfg.GatewayID = "gw-test"
	}
	srv, err := gateway.New(cfg, gateway.Deps{DB: e.db, NC: e.natsConn(), Logger: telemetry.Discard(), Clock: e.clk,
		Metrics: e.metrics})
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			require.NoError(e.t, <-done)
		})
	}
	e.t.Cleanup(stop)
	return &gw{srv: srv, addr: ln.Addr().String(), controlURL: "http://" + cfg.ControlListener.Addr().String(), stop: stop}
}

// relay runs the outbox relay until the test ends.
func (e *env) relay() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	r := &outbox.Relay{DB: e.db, NC: e.nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: 50 * time.Millisecond}
	go func() { defer close(done); _ = r.Run(ctx) }()
	e.t.Cleanup(func() { cancel(); <-done })
}

// node is a node row with a client certificate.
type node struct {
	id   string
	cert tls.Certificate
}

// newNode inserts a node in state accepting and issues and records its
// certificate.
func (e *env) newNode() node {
	e.t.Helper()
	return e.newNodeWith(storetest.NodeOpts{}, time.Time{})
}

// newNodeWith is newNode with the node's state in opts (its pool and
// provision state are set here), its certificate revoked at certRevokedAt
// (never when zero).
func (e *env) newNodeWith(opts storetest.NodeOpts, certRevokedAt time.Time) node {
	e.t.Helper()
	n := e.newUnrecordedNodeWith(opts)
	e.recordCert(n.id, n.cert.Leaf, certRevokedAt)
	return n
}

// recordCert records leaf as a certificate of node id (node_certs),
// revoked at revokedAt (never when zero).
func (e *env) recordCert(id string, leaf *x509.Certificate, revokedAt time.Time) {
	e.t.Helper()
	storetest.NodeCert(e.t, e.db, &storetest.NodeCertOpts{NodeID: id, Serial: pki.SerialHex(leaf),
		PublicKeySHA256: pki.PublicKeySHA256(leaf), NotBefore: leaf.NotBefore, NotAfter: leaf.NotAfter, RevokedAt: revokedAt})
}

// newUnrecordedNode inserts a node and issues it a certificate that
// node_certs does not know.
func (e *env) newUnrecordedNode() node {
	e.t.Helper()
	return e.newUnrecordedNodeWith(storetest.NodeOpts{})
}

// newUnrecordedNodeWith is newUnrecordedNode with the node's state in opts.
func (e *env) newUnrecordedNodeWith(opts storetest.NodeOpts) node {
	e.t.Helper()
	opts.PoolID, opts.State = e.poolID, store.NodeAccepting
	id := storetest.Node(e.t, e.db, &opts).ID
	return node{id: id, cert: e.issue(id)}
}

// issue returns a node certificate for id signed by the node CA.
func (e *env) issue(id string) tls.Certificate {
	e.t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(e.t, err)
	der, err := pki.NewCSR(key, id)
	require.NoError(e.t, err)
	csr, err := pki.ParseCSR(der)
	require.NoError(e.t, err)
	leaf, err := e.nodeCA.IssueNode(csr, id, e.trustDomain, realClock.Now(), 24*time.Hour)
	require.NoError(e.t, err)
	return tls.Certificate{Certificate: [][]byte{leaf.Raw}, PrivateKey: key, Leaf: leaf}
}

// client returns a Connect client of g presenting cert over HTTP/2 mTLS.
func (e *env) client(g *gw, cert tls.Certificate) gatewayv1connect.GatewayServiceClient {
	return e.clientDialing(g, cert, nil)
}

// clientWith is client with the Connect options opts.
func (e *env) clientWith(g *gw, cert tls.Certificate, opts ...connect.ClientOption) gatewayv1connect.GatewayServiceClient {
	return e.clientDialing(g, cert, nil, opts...)
}

// clientDialing is client, dialing its connections with dial (net.Dialer's
// when nil), with the Connect options opts.
func (e *env) clientDialing(g *gw, cert tls.Certificate, dial func(ctx context.Context, network, addr string) (net.Conn, error),
	opts ...connect.ClientOption) gatewayv1connect.GatewayServiceClient {
	var p http.Protocols
	p.SetHTTP2(true)
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: e.servingCAs, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13},
		Protocols:       &p,
		DialContext:     dial,
	}
	e.t.Cleanup(tr.CloseIdleConnections)
	return gatewayv1connect.NewGatewayServiceClient(&http.Client{Transport: tr}, "https://"+g.addr, opts...)
}

// clientStream is the daemon's end of a session: Connect's
// BidiStreamForClient or sessionwire's ClientStream.
type clientStream interface {
	Send(*gatewayv1.SessionRequest) error
	Receive() (*gatewayv1.SessionResponse, error)
	CloseRequest() error
	CloseResponse() error
}

// daemon is the client side of one session.
type daemon struct {
	t      testing.TB
	stream clientStream
	msgs   chan *gatewayv1.SessionResponse // every message but HeartbeatAcks
	acks   chan int64                      // seq of each HeartbeatAck (the latest 64 kept)
	err    chan error                      // the Receive error that ended the stream
	cancel context.CancelFunc
	done   chan struct{}
}

// open starts a session of n on g over the framed transport, as daemons
// do (pkg/sessionwire), and sends hello; it does not wait for the answer.
func (e *env) open(g *gw, n node, hello *gatewayv1.Hello) *daemon {
	e.t.Helper()
	return e.openFramed(g, n.cert, nil, hello)
}

// openFramed is open presenting cert, dialing with dial (net.Dialer's when
// nil).
func (e *env) openFramed(g *gw, cert tls.Certificate, dial sessionwire.Dialer, hello *gatewayv1.Hello) *daemon {
	ctx, cancel := context.WithCancel(context.Background())
	cfg := &tls.Config{RootCAs: e.servingCAs, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}
	return e.start(sessionwire.NewClientStream(ctx, dial, g.addr, cfg, service.MaxMessageBytes), cancel, hello)
}

// openWith starts a session through the Connect client c (over HTTP/2) and
// sends hello; it does not wait for the answer.
func (e *env) openWith(c gatewayv1connect.GatewayServiceClient, hello *gatewayv1.Hello) *daemon {
	ctx, cancel := context.WithCancel(context.Background())
	return e.start(c.Session(ctx), cancel, hello)
}

func (e *env) start(stream clientStream, cancel context.CancelFunc, hello *gatewayv1.Hello) *daemon {
	d := &daemon{t: e.t, stream: stream, msgs: make(chan *gatewayv1.SessionResponse, 64),
		acks: make(chan int64, 64), err: make(chan error, 1), cancel: cancel, done: make(chan struct{})}
	e.t.Cleanup(d.close)
	go func() {
		defer close(d.done)
		for {
			m, err := d.stream.Receive()
			if err != nil {
				d.err <- err
				return
			}
			if a := m.GetHeartbeatAck(); a != nil {
				select {
				case d.acks <- a.GetSeq():
				default:
				}
				continue
			}
			d.msgs <- m
		}
	}()
	if hello != nil {
		d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Hello{Hello: hello}})
	}
	return d
}

// connect opens a session of n and waits for its Welcome.
func (e *env) connect(g *gw, n node, hello *gatewayv1.Hello) (*daemon, *gatewayv1.Welcome) {
	e.t.Helper()
	if hello == nil {
		hello = &gatewayv1.Hello{NodeId: n.id, BootId: "boot-1", AgentVersion: "test"}
	}
	return e.welcome(e.open(g, n, hello))
}

// welcome waits for d's Welcome.
func (e *env) welcome(d *daemon) (*daemon, *gatewayv1.Welcome) {
	e.t.Helper()
	w := d.next().GetWelcome()
	require.NotNil(e.t, w, "first message is Welcome")
	return d, w
}

// connectWith opens a session with hello through c and waits for its
// Welcome.
func (e *env) connectWith(c gatewayv1connect.GatewayServiceClient, hello *gatewayv1.Hello) (*daemon, *gatewayv1.Welcome) {
	e.t.Helper()
	return e.welcome(e.openWith(c, hello))
}

func (d *daemon) send(m *gatewayv1.SessionRequest) {
	d.t.Helper()
	require.NoError(d.t, d.stream.Send(m))
}

// next returns the next message, failing the test after waitFor or when
// the stream ended with no message left. Messages received before the end
// come first: the reader queues them before the error, but a select on both
// channels would pick either.
func (d *daemon) next() *gatewayv1.SessionResponse {
	d.t.Helper()
	timer := realClock.NewTimer(waitFor)
	defer timer.Stop()
	select {
	case m := <-d.msgs:
		return m
	case err := <-d.err:
		d.err <- err
		select {
		case m := <-d.msgs:
			return m
		default:
		}
		require.FailNow(d.t, "stream ended", "%v", err)
	case <-timer.C():
		require.FailNow(d.t, "no message from the gateway")
	}
	return nil
}

// nextAck returns the seq of the next HeartbeatAck, failing the test after
// waitFor.
func (d *daemon) nextAck() int64 {
	d.t.Helper()
	timer := realClock.NewTimer(waitFor)
	defer timer.Stop()
	select {
	case seq := <-d.acks:
		return seq
	case <-timer.C():
		require.FailNow(d.t, "no heartbeat ack from the gateway")
	}
	return 0
}

// ended waits for the stream to end and returns its error, nil when the
// gateway ended it without one.
func (d *daemon) ended() error {
	d.t.Helper()
	timer := realClock.NewTimer(waitFor)
	defer timer.Stop()
	for {
		select {
		case <-d.msgs:
		case err := <-d.err:
			d.err <- err
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case <-timer.C():
			require.FailNow(d.t, "stream did not end")
		}
	}
}

func (d *daemon) close() {
	_ = d.stream.CloseRequest()
	d.cancel()
	<-d.done
	_ = d.stream.CloseResponse()
}

func (d *daemon) heartbeat(seq, observed int64) {
	d.t.Helper()
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{Seq: seq, ObservedGeneration: observed}}})
}

func (d *daemon) update(id string, state gatewayv1.CommandState, result *gatewayv1.CommandResult, errText string) {
	d.t.Helper()
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
		CommandId: id, State: state, Result: result, Error: errText}}})
}

func (d *daemon) observed(gen int64) {
	d.t.Helper()
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
		Report: &gatewayv1.Report_ObservedGeneration{ObservedGeneration: gen}}}})
}

// nodeRow is what the tests read of a node.
type nodeRow struct {
	GatewayID, SessionID *string
	Epoch                int64
	BootID, Agent        string
	Reachable            bool
	LastSeen             *time.Time
	Observed             int64
}

func (e *env) nodeRow(id string) nodeRow {
	e.t.Helper()
	var r nodeRow
	err := e.db.Pool.QueryRow(context.Background(), `SELECT gateway_id, session_id, session_epoch, boot_id, agent_version,
		reachable, last_seen, observed_generation FROM nodes WHERE id = $1`, id).Scan(
		&r.GatewayID, &r.SessionID, &r.Epoch, &r.BootID, &r.Agent, &r.Reachable, &r.LastSeen, &r.Observed)
	require.NoError(e.t, err)
	return r
}

// queueCommand inserts a queued command for node and returns its id.
func (e *env) queueCommand(nodeID, kind, purpose string) string {
	e.t.Helper()
	return e.insertCommand(storetest.CommandOpts{NodeID: nodeID, Kind: kind, Purpose: purpose})
}

// insertCommand inserts the command of opts, by default queued, retry-safe, with
// arguments {"verbose": true} and due in an hour, and returns its id.
func (e *env) insertCommand(opts storetest.CommandOpts) string {
	e.t.Helper()
	opts.Args = cmp.Or(opts.Args, `{"verbose": true}`)
	if opts.RetrySafe == nil {
		opts.RetrySafe = new(true)
	}
	return storetest.Command(e.t, e.db, &opts).ID
}

// outboxCount counts outbox rows of subject.
func (e *env) outboxCount(subject string) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE subject = $1`, subject).Scan(&n))
	return n
}

// clientTLSWithoutCert trusts the gateway but presents no certificate.
func (e *env) clientTLSWithoutCert() *tls.Config {
	return &tls.Config{RootCAs: e.servingCAs, MinVersion: tls.VersionTLS13}
}

func certSerial(n node) string { return pki.SerialHex(n.cert.Leaf) }

// commandRow is what the tests read of a command.
type commandRow struct {
	State       string
	Deliveries  int
	DeliveredAt *time.Time
	FinishedAt  *time.Time
	Result      []byte
	Error       string
}

func (e *env) command(id string) commandRow {
	e.t.Helper()
	var c commandRow
	err := e.db.Pool.QueryRow(context.Background(), `SELECT state, deliveries, delivered_at, finished_at, result, error
		FROM commands WHERE id = $1`, id).Scan(&c.State, &c.Deliveries, &c.DeliveredAt, &c.FinishedAt, &c.Result, &c.Error)
	require.NoError(e.t, err)
	return c
}

// eventually polls cond until it holds, failing after waitFor.
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	require.Eventually(t, cond, waitFor, 20*time.Millisecond, msg)
}

func connectCode(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return connect.CodeUnknown
}
