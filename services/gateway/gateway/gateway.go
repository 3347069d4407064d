// Package gateway serves the daemons' sessions: bc.gateway.v1.GatewayService/
// Session, a Connect bidi stream over HTTP/2 with mutual TLS (node
// certificates signed by the node CA); and the tunnels to their machines
// (tunnel.go): the API's end on a control server of its own (h2c,
// GatewayControlService), the node's end beside its session
// (GatewayService/Tunnel).
//
// A session starts with Hello; the gateway checks the client certificate
// against the node and node_certs, makes the stream the node's live session
// (nodes.gateway_id, session_id, session_epoch+1) and answers Welcome. It then
// delivers the node's open commands and, whenever spec_generation is above
// what the daemon reported and what this session already sent, the
// DesiredState. Work arrives as NATS pokes on bc.poke.gw.<gateway id> and,
// since pokes are hints that may be lost, through a periodic re-read of all
// sessions' pending work in one query. Heartbeats and other messages record
// last_seen through a batch that one loop flushes every FlushInterval.
// Each heartbeat is answered at once with a HeartbeatAck from the handler's
// goroutine (skipped when a delivery is being sent
// at that moment, which answers it), so that a daemon notices a gateway
// that hangs without closing its connections (paused, stuck) and moves to
// another.
//
// Trust: a session is refused at Hello, and an open one closed with
// Unauthenticated "certificate revoked", when its certificate or its node is
// revoked (RevokeNode pokes the gateway; the periodic re-read is the
// backstop). A daemon renews its certificate on the session
// (RenewCertificate): the gateway, which holds no key of the node CA, has
// JoinService decide and sign it (bc.join.v1.NodeCertService, over mutual
// TLS with its own certificate, at JoinServiceURL), forwarding the daemon's
// proof of the request, and answers CertificateIssued, never dropping the
// session. A session lasts as long as the certificate its
// authority rests on: the client certificate, then the last one renewed on
// it (the daemon stays on the connection of its old certificate and presents
// the new one from its next dial, so a renewal on time extends the session).
// Past that certificate's NotAfter the session is closed (Unauthenticated
// "the session's certificate expired at …") by the next resync or delivery,
// and JoinService refuses a renewal; it also refuses one when that
// certificate or the client certificate is revoked, and more than one
// certificate per node per NODE_CERT_RENEW_INTERVAL. Commands and
// DesiredStates carry the signatures stored with them (signedIntent)
// untouched; the gateway holds no signing key. Spec refusals daemons report become node.spec_refused events.
//
// Memory per session is kept small for thousands of idle sessions. A
// framed session (pkg/sessionwire, as daemons use) is one goroutine, which
// waits for the daemon's next bytes at a shallow frame (waitFramed) where
// the runtime shrinks its stack to 4 KiB, and about 13 KiB of live heap,
// nearly all crypto/tls's (the connection, the read and handshake buffers
// it keeps, the AEAD states, the client certificate); the gateway's own
// state is about 1 KiB (the session record, its context, map entries).
// Over Connect (HTTP/2) the handler waits in sessionBody.fill, with an 8 KiB
// stack, beside net/http's connection goroutines and buffers. Deliveries
// run on a short-lived goroutine started when a session is woken (one at a
// time per session, wakes coalesce); timers and tickers are shared by all
// sessions. BenchmarkIdleSessionMemory measures it.
//
// SshRefused reports become node.ssh_refused events, written as spec
// refusals are.
//
// To handle a new daemon message, give it a decoder in decode.go (and a case
// in FuzzSessionMessage) and add a case to (*Server).handle; to send a
// new kind of message, add it to (*Server).deliver so that it is covered by
// the coalescing wake-up and by the periodic re-read.
package gateway

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"github.com/nats-io/nats.go"

	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Name is the gateway's name in logs, errors and `gateway healthcheck`.
const Name = "gateway"

// Config configures a gateway. The binary reads it from the environment
// (pkg/config; docs/configuration.md lists the variables); New gives every
// zero field its default, and reads the TLS pieces that are unset from
// PKIDir (gateway.crt, gateway.key, node-ca.crt, serving-ca.crt,
// trust-domain).
type Config struct {
	service.Database
	service.NATS
	service.PKI
	// GatewayID names this replica in nodes.gateway_id and in its poke
	// subject, bc.poke.gw.<id>; replicas must have distinct ids. Unset:
	// gw-<hostname> (DefaultGatewayID).
	GatewayID string `env:"GATEWAY_ID"`
	// Listen is the address of the mutual-TLS Session server.
	Listen string `env:"LISTEN" default:":8443"`
	// Listener, when set, is where the mTLS server accepts connections
	// instead of Listen (plain TCP: the gateway does TLS itself); Run closes
	// it. Tests and `better-compute dev` pass one on 127.0.0.1:0.
	Listener net.Listener
	// Probes serve GET /healthz and GET /readyz on a plain HTTP listener of
	// their own.
	service.Probes `default:"HEALTH_LISTEN=:8082"`
	// HTTPLimits are the limits of each of its servers (sessions, control,
	// probes): a gateway holds a connection per machine, and the API's
	// connections to its control server carry up to 256 tunnels each. The
	// sessions server allows TunnelsPerNode + 4 streams per connection (a
	// machine's session and tunnels), whatever HTTPMaxStreams says. Its
	// Session and Tunnel streams are long-lived (service.LongLived), bounded
	// by HelloTimeout, IdleTimeout and TunnelOpenTimeout instead.
	service.HTTPLimits `default:"HTTP_MAX_CONNECTIONS=20000;HTTP_MAX_STREAMS=256"`
	// ServingCert is the gateway's TLS certificate and key, also its client
	// certificate toward JoinService; PKIDir's gateway.crt and gateway.key
	// when nil.
	ServingCert *tls.Certificate
	// ClientCAs verify the nodes' client certificates; PKIDir's node-ca.crt
	// when nil.
	ClientCAs *x509.CertPool
	// TrustDomain is the SPIFFE trust domain of node certificates;
	// pki.ReadTrustDomain(PKIDir) when empty.
	TrustDomain string
	// JoinServiceURL is where the gateway has the certificates daemons
	// renew over their sessions signed: JoinService's control listener
	// (bc.join.v1.NodeCertService), https://HOST:PORT, over mutual TLS with
	// the gateway's certificate, verified with PKIDir's serving-ca.crt and
	// HOST.
	JoinServiceURL string `env:"GATEWAY_JOINSERVICE_URL" default:"https://joinservice:8087"`
	// HeartbeatInterval is how often machines are told to send a heartbeat
	// (Welcome.heartbeat_interval).
	HeartbeatInterval time.Duration `env:"HEARTBEAT_INTERVAL,positive" default:"10s"`
	// ResyncInterval is how often the gateway re-reads the pending work of
	// all its sessions, so that a lost poke only delays work; the same loop
	// closes silent streams and the sessions whose certificate expired.
	ResyncInterval time.Duration `env:"GATEWAY_RESYNC,positive" default:"5s"`
	// FlushInterval is how often heard-from nodes' last_seen (and the
	// generations their heartbeats report) are written, in one statement,
	// with the gateway's presence: last_seen in the database lags by at most
	// about this much plus half HeartbeatInterval (a session's hearings that
	// closely follow a written one are left out: lastSeenBatcher). At most 2 s (store.MaxGatewayFlushInterval, which the
	// liveness invariant I4 needs), else the gateway does not start.
	FlushInterval time.Duration `env:"GATEWAY_FLUSH_INTERVAL,positive" default:"1s"`
	// FlushBatch flushes early when this many nodes are pending, bounding
	// both staleness under load and the size of one statement.
	FlushBatch int `default:"5000"`
	// IdleTimeout closes a session from which nothing was received for this
	// long, checked at every resync. Unset or not positive: 3 heartbeat
	// intervals.
	IdleTimeout time.Duration `env:"GATEWAY_IDLE_TIMEOUT"`
	// HelloTimeout closes a stream that sent no Hello for this long.
	HelloTimeout time.Duration `default:"10s"`

	// ControlListen is the address of the control server: cleartext HTTP/2
	// (h2c) serving GatewayControlService, where the API opens tunnels
	// (docs/architecture.md, "Tunnels"). Each tunnel is authenticated by
	// its exec ticket, but the server is for the control plane's network
	// only, never the machines'.
	ControlListen string `env:"CONTROL_LISTEN" default:":8086"`
	// ControlListener, when set, is where the control server accepts
	// connections instead of ControlListen; Run closes it. Tests and
	// `better-compute dev` pass one on 127.0.0.1:0.
	ControlListener net.Listener
	// ControlURL is where the API reaches the control server, http://HOST:PORT,
	// recorded in gateways.control_url at start. Unset: http://<host
	// name>:<port of CONTROL_LISTEN>, with its IP instead of the host name
	// when it listens on a specific one (Go callers: ControlListener's
	// address when it is set).
	ControlURL string `env:"CONTROL_URL"`
	// TicketKey verifies exec tickets (pkg/tunnel); PKIDir's
	// tunnel-ticket.pub when nil. Without a key the gateway runs but
	// refuses every tunnel (FailedPrecondition "tunnels are not
	// configured: …").
	TicketKey ed25519.PublicKey
	// TunnelOpenTimeout is how long a tunnel waits for its node to dial
	// back (GatewayService.Tunnel) once OpenTunnel is queued on the node's
	// session; then it fails with DeadlineExceeded.
	TunnelOpenTimeout time.Duration `env:"GATEWAY_TUNNEL_OPEN_TIMEOUT,positive" default:"10s"`
	// TunnelsPerNode is the most tunnels, pending or open, that one node
	// has through this gateway; one more is refused with
	// ResourceExhausted. The API's limits (per node and per token, across
	// gateways) come first; this one bounds what one gateway holds.
	TunnelsPerNode int `env:"GATEWAY_TUNNELS_PER_NODE,positive" default:"16"`
	// GCPercent is the garbage collector's target that the gateway binary
	// sets at start (as GOGC, runtime/debug.SetGCPercent): a collection
	// starts once the heap has grown by this percentage of what the last
	// one left live, plus the goroutines' stacks. A gateway's memory is
	// nearly all its idle sessions', live for as long as they are
	// connected, and the runtime keeps what the heap grows to between
	// collections: at Go's default, 100, an idle session costs about
	// 47 KiB of resident memory, at 25 about 33 KiB, for more frequent
	// collections (with 1,000 idle machines about 7 a minute instead of 2).
	// Busy, that target would collect several times a second: while the
	// heap grows faster than it lets it (a join burst, a stream of
	// commands) the gateway uses Go's default, and comes back to this one
	// 6 s after (docs/benchmarks.md). The GOGC variable, when set, wins;
	// `better-compute dev`, one process of every service, keeps Go's
	// default.
	GCPercent int `env:"GATEWAY_GC_PERCENT,positive" default:"25"`
}

// NewProcess is New for the gateway binary, whose process holds the
// gateway alone: it first sets the process's garbage collector target to
// cfg.GCPercent, unless getenv("GOGC") is set, and when that is below Go's
// default the gateway keeps it only while idle (gcTuner: Go's default
// while busy).
func NewProcess(cfg Config, deps Deps) (*Server, error) {
	tune := applyGCPercent(cfg.GCPercent, os.Getenv) && cfg.GCPercent < busyGCPercent
	s, err := New(cfg, deps)
	if err != nil {
		return nil, err
	}
	if tune {
		s.gc = newGCTuner(cfg.GCPercent)
	}
	return s, nil
}

// applyGCPercent sets the garbage collector's target to percent
// (debug.SetGCPercent), unless getenv("GOGC") is set or percent is not
// positive, and returns whether it did.
func applyGCPercent(percent int, getenv func(string) string) bool {
	if percent <= 0 || getenv("GOGC") != "" {
		return false
	}
	debug.SetGCPercent(percent)
	return true
}

// Deps are the gateway's dependencies: DB and NC (the pokes) are required.
type Deps = service.Deps

// DefaultGatewayID returns "gw-" + the host name (or "gw-local" when the
// host name is unknown).
func DefaultGatewayID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "gw-local"
	}
	return "gw-" + h
}

// Server is a gateway replica. Create it with New and run it with Run.
type Server struct {
	cfg  Config
	deps Deps
	// gc, when set (the gateway binary: NewProcess), moves the collector's
	// target between cfg.GCPercent and Go's default as the gateway idles
	// or is busy.
	gc      *gcTuner
	metrics *metrics
	db      *store.DB
	nc      *nats.Conn
	log     *slog.Logger
	clk     clock.Clock
	tls     *tls.Config
	handler http.Handler
	// control is the control server's handler (GatewayControlService).
	control http.Handler
	// ticketKey verifies exec tickets; nil when the gateway has none, and
	// ticketErr says why.
	ticketKey ed25519.PublicKey
	ticketErr error
	seen      *lastSeenBatcher
	// batch holds the batched writes of the sessions; set by Run before
	// it serves, closed once every session ended.
	batch *batchers
	// pokeRows are the outbox rows whose poke this gateway acted on
	// (onPoke), to drop the other copy of each.
	pokeRows recentIDs

	mu      sync.Mutex
	streams map[*session]struct{} // every open stream, before and after Hello
	byNode  map[string]*session   // the newest session of each node past Hello
	// unclosed are ended sessions whose CloseSession write failed; resync
	// writes them again, so that no node keeps a live session in the
	// database that no gateway holds (the sweeper would never judge it).
	unclosed []unclosedSession
	closing  bool // no new streams once shutdown started

	// tunnels are the pending and open tunnels by id, ofNode the same by
	// node, and tickets the ids of the exec tickets seen, each kept until
	// its expiry (tunnel.go).
	tunnels        map[string]*tunnel
	ofNode         map[string]map[*tunnel]struct{}
	tickets        map[string]time.Time
	tunnelsClosing bool // no new tunnels once shutdown started

	// nodeCerts is JoinService's NodeCertService, which signs renewals.
	nodeCerts joinv1connect.NodeCertServiceClient
	// nodeCertsTransport is its transport, whose connections Run closes.
	nodeCertsTransport *http.Transport

	handlers       sync.WaitGroup // running Session handlers
	renewals       sync.WaitGroup // renewals being decided (renew)
	tunnelHandlers sync.WaitGroup // running Tunnel handlers, of both services
	ran            atomic.Bool
}

// New checks cfg, fills its defaults, loads the TLS pieces that are unset
// from cfg.PKIDir and returns a gateway ready to Run. Errors name the missing
// dependency or the file that could not be read.
func New(cfg Config, deps Deps) (*Server, error) {
	deps, err := deps.Complete(Name, true)
	if err != nil {
		return nil, err
	}
	config.SetDefaults(&cfg)
	if cfg.GatewayID == "" {
		cfg.GatewayID = DefaultGatewayID()
	}
	if cfg.FlushInterval > store.MaxGatewayFlushInterval {
		return nil, fmt.Errorf("gateway: FlushInterval %s is above %s, which the liveness invariant I4 needs",
			cfg.FlushInterval, store.MaxGatewayFlushInterval)
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 3 * cfg.HeartbeatInterval
	}
	if cfg.ServingCert == nil {
		c, err := tls.LoadX509KeyPair(filepath.Join(cfg.PKIDir, pki.GatewayCert), filepath.Join(cfg.PKIDir, pki.GatewayKey))
		if err != nil {
			return nil, fmt.Errorf("gateway: load serving certificate: %w", err)
		}
		cfg.ServingCert = &c
	}
	if cfg.ClientCAs == nil {
		ca, err := pki.LoadCert(filepath.Join(cfg.PKIDir, pki.NodeCACert))
		if err != nil {
			return nil, fmt.Errorf("gateway: load the node CA that client certificates chain to: %w", err)
		}
		cfg.ClientCAs = x509.NewCertPool()
		cfg.ClientCAs.AddCert(ca)
	}
	nodeCerts, nodeCertsTransport, err := newNodeCertClient(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.TrustDomain == "" {
		td, err := pki.ReadTrustDomain(cfg.PKIDir)
		if err != nil {
			return nil, fmt.Errorf("gateway: read trust domain: %w", err)
		}
		cfg.TrustDomain = td
	}
	if cfg.ControlURL == "" {
		cfg.ControlURL = defaultControlURL(cfg.ControlListen, cfg.ControlListener)
	}
	if err := checkControlURL(cfg.ControlURL); err != nil {
		return nil, err
	}
	s := &Server{
		cfg:     cfg,
		deps:    deps,
		db:      deps.DB,
		nc:      deps.NC,
		log:     deps.Logger.With(telemetry.KeyGatewayID, cfg.GatewayID),
		clk:     deps.Clock,
		streams: make(map[*session]struct{}),
		byNode:  make(map[string]*session),
		tunnels: make(map[string]*tunnel),
		ofNode:  make(map[string]map[*tunnel]struct{}),
		tickets: make(map[string]time.Time),

		nodeCerts:          nodeCerts,
		nodeCertsTransport: nodeCertsTransport,
	}
	if s.metrics, err = newMetrics(deps.Metrics, cfg.GatewayID, s.sessionCount); err != nil {
		return nil, fmt.Errorf("gateway: metrics: %w", err)
	}
	s.ticketKey, s.ticketErr = cfg.TicketKey, nil
	if s.ticketKey == nil {
		s.ticketKey, s.ticketErr = loadTicketKey(filepath.Join(cfg.PKIDir, pki.TunnelTicketPub))
	}
	if s.ticketErr != nil {
		s.log.Warn("the gateway refuses every tunnel", telemetry.KeyError, s.ticketErr)
	}
	s.seen = newLastSeenBatcher(s.db, s.clk, s.log, cfg.GatewayID, cfg.FlushInterval, cfg.HeartbeatInterval/2, cfg.FlushBatch, s.fence)
	s.tls = &tls.Config{
		Certificates: []tls.Certificate{*cfg.ServingCert},
		ClientCAs:    cfg.ClientCAs,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		// The framed session transport first: a daemon that offers it
		// gets it (serveFramed); Connect clients offer only h2.
		NextProtos: []string{sessionwire.ALPN, "h2"},
		MinVersion: tls.VersionTLS13,
		// Daemons never resume a TLS session (each dial is a full
		// handshake, its client certificate verified): a ticket, which
		// encrypts the client certificate, would be work at every join
		// for nothing.
		SessionTicketsDisabled: true,
	}
	mux := http.NewServeMux()
	// Session deliberately runs without service.HandlerOptions: an
	// otelconnect span would live as long as the session (hours) and
	// collect an event per message, Session validates each message it
	// receives itself (Server.receive), and Session returns explicit Connect
	// codes, so the masking of internal errors has nothing to do. Together
	// they cost about 6 KiB per idle session (BenchmarkIdleSessionMemory).
	// Database calls are still traced by otelpgx. Its messages have the
	// limits of every handler (service.MessageOptions).
	mux.Handle(gatewayv1connect.NewGatewayServiceHandler(s, service.MessageOptions()...))
	// The node's end of a tunnel has options of its own (tunnelOptions),
	// on the more specific path.
	mux.Handle(gatewayv1connect.GatewayServiceTunnelProcedure, connect.NewBidiStreamHandler(
		gatewayv1connect.GatewayServiceTunnelProcedure, s.Tunnel, tunnelOptions()...))
	mux.Handle(grpchealth.NewHandler(grpchealth.NewStaticChecker(gatewayv1connect.GatewayServiceName), service.MessageOptions()...))
	s.handler = s.peerMiddleware(mux)

	cmux := http.NewServeMux()
	cmux.Handle(gatewayv1connect.NewGatewayControlServiceHandler(controlService{s}, tunnelOptions()...))
	cmux.Handle(grpchealth.NewHandler(grpchealth.NewStaticChecker(gatewayv1connect.GatewayControlServiceName),
		service.MessageOptions()...))
	s.control = streamMiddleware(cmux)
	return s, nil
}

// defaultControlURL is http://HOST:PORT of the control server listening on
// ln (when set) or addr: HOST is the listener's IP when it is a specific
// one, else the host name (localhost when unknown).
func defaultControlURL(addr string, ln net.Listener) string {
	if ln != nil {
		addr = ln.Addr().String()
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		host, port = "", addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "localhost"
		if h, err := os.Hostname(); err == nil && h != "" {
			host = h
		}
	}
	return "http://" + net.JoinHostPort(host, port)
}

// checkControlURL refuses a ControlURL that is not http(s)://HOST[:PORT].
func checkControlURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return &config.Error{Name: config.Prefix + "CONTROL_URL", Err: fmt.Errorf("%q is not http://HOST:PORT", s)}
	}
	return nil
}

// loadTicketKey reads the tunnel-ticket public key at path.
func loadTicketKey(path string) (ed25519.PublicKey, error) {
	pub, _, err := pki.LoadPublicKey(path)
	if err != nil {
		return nil, err
	}
	key, ok := pub.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("%s: not an Ed25519 public key", path)
	}
	return key, nil
}

// GatewayID returns the gateway's id.
func (s *Server) GatewayID() string { return s.cfg.GatewayID }

// TLSConfig returns the server's TLS configuration (mutual TLS, h2 only). Do
// not modify it.
func (s *Server) TLSConfig() *tls.Config { return s.tls }

// Handler returns the HTTP handler of the mTLS server. It expects requests
// over TLS with a verified client certificate (r.TLS.PeerCertificates), and
// serves sessions only while Run runs (Run starts the batched writes they
// use).
func (s *Server) Handler() http.Handler { return s.handler }

// Sessions returns the number of sessions past Hello that this gateway holds.
func (s *Server) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.byNode)
}

// Name returns Name (service.Runner).
func (s *Server) Name() string { return Name }

// Run serves sessions until ctx ends, through the service lifecycle
// (service.Run): the mTLS Session server on Listen and, unless
// NoHealthServer, the probes on HealthListen. At the end it closes every
// session (each clears itself in the database), waits for them, flushes
// last_seen and returns. It returns an error when a listener cannot be
// opened, the sessions of a previous run cannot be cleared, or a server
// fails. Run may be called once.
func (s *Server) Run(ctx context.Context) error {
	if !s.ran.CompareAndSwap(false, true) {
		return errors.New("gateway: Run called twice")
	}
	// The control server stops first: its tunnels close (saying the
	// gateway is shutting down) before the sessions do.
	servers := append([]service.HTTPServer{
		// The listener does the TLS (sessionListener): the framed
		// sessions never reach the http.Server.
		{Name: "sessions", Addr: s.cfg.Listen, Listener: s.cfg.Listener, Handler: s.handler, WrapListener: s.listen,
			Tune: s.tuneHTTP, Limits: s.cfg.HTTPLimits, OnShutdown: s.closeAll},
		{Name: "control", Addr: s.cfg.ControlListen, Listener: s.cfg.ControlListener, Handler: s.control, Tune: tuneControl,
			Limits: s.cfg.HTTPLimits, OnShutdown: s.closeTunnels},
	}, s.probeServers()...)
	// The loops outlive the servers, and the sessions that end as they
	// stop: those still clear themselves and get their last_seen flushed.
	return service.Run(ctx, service.Spec{Name: Name, Deps: s.deps, Servers: servers,
		Parts: []service.Runner{&loops{s: s}, service.OnStop("sessions", s.endSessions)}})
}

// probeServers are the probes server (service.Probes), with the gateway's
// limits.
func (s *Server) probeServers() []service.HTTPServer {
	servers := s.cfg.Servers()
	for i := range servers {
		servers[i].Limits = s.cfg.HTTPLimits
	}
	return servers
}

// endSessions aborts every open stream and tunnel and waits for their
// handlers and renewals.
func (s *Server) endSessions() {
	s.closeAll()
	s.handlers.Wait()
	s.tunnelHandlers.Wait()
	s.renewals.Wait()
	s.nodeCertsTransport.CloseIdleConnections()
}

// newNodeCertClient returns the client of JoinService's NodeCertService at
// cfg.JoinServiceURL: HTTP/2 over TLS 1.3, the gateway's certificate as
// client certificate, JoinService's verified with PKIDir's serving-ca.crt.
func newNodeCertClient(cfg Config) (joinv1connect.NodeCertServiceClient, *http.Transport, error) {
	u, err := url.Parse(cfg.JoinServiceURL)
	if err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return nil, nil, &config.Error{Name: config.Prefix + "GATEWAY_JOINSERVICE_URL",
			Err: fmt.Errorf("%q is not https://HOST:PORT", cfg.JoinServiceURL)}
	}
	ca, err := pki.LoadCert(filepath.Join(cfg.PKIDir, pki.ServingCACert))
	if err != nil {
		return nil, nil, fmt.Errorf("gateway: load the serving CA that JoinService's certificate chains to: %w", err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	var p http.Protocols
	p.SetHTTP2(true)
	tr := &http.Transport{
		Protocols: &p,
		TLSClientConfig: &tls.Config{
			Certificates: []tls.Certificate{*cfg.ServingCert},
			RootCAs:      roots,
			MinVersion:   tls.VersionTLS13,
		},
		IdleConnTimeout:     time.Minute,
		TLSHandshakeTimeout: 10 * time.Second,
	}
	client := joinv1connect.NewNodeCertServiceClient(&http.Client{Transport: tr}, strings.TrimSuffix(cfg.JoinServiceURL, "/"))
	return client, tr, nil
}

// loops is the gateway's own part of its run.
type loops struct {
	s   *Server
	sub *nats.Subscription
}

func (l *loops) Name() string { return "session loops" }

// Start clears the sessions a previous run of this gateway id left behind,
// subscribes to the gateway's pokes and starts the batched writes of the
// sessions, before the Session server accepts one.
func (l *loops) Start(ctx context.Context) error {
	s := l.s
	if n, err := store.ResetGatewaySessions(ctx, s.db.Pool, s.db.Now(), s.cfg.GatewayID); err != nil {
		return err
	} else if n > 0 {
		s.log.Info("cleared sessions of a previous run", "nodes", n)
	}
	if err := store.RegisterGateway(ctx, s.db.Pool, s.cfg.GatewayID, s.cfg.ControlURL, s.db.Now()); err != nil {
		return err
	}
	subject := store.SubjectPokeGatewayPrefix + s.cfg.GatewayID
	sub, err := s.nc.Subscribe(subject, s.onPoke)
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", subject, err)
	}
	l.sub = sub
	s.batch = s.startBatchers()
	s.log.Info("gateway starting", "poke_subject", subject, "control_url", s.cfg.ControlURL)
	return nil
}

// Run runs the resync and last_seen loops (and the collector's tuning,
// gcTuner, in the gateway binary) until ctx ends, then stops the
// batched writes and the subscription.
func (l *loops) Run(ctx context.Context) error {
	s := l.s
	defer func() { _ = l.sub.Unsubscribe() }()
	defer s.batch.close()
	var wg sync.WaitGroup
	wg.Go(func() { s.resyncLoop(ctx) })
	wg.Go(func() { s.seen.run(ctx) })
	if s.gc != nil {
		wg.Go(func() { s.gc.run(ctx, s.clk) })
	}
	wg.Wait()
	return nil
}

// tuneHTTP makes the Session server HTTP/2 only, with the limits of
// long-lived sessions. It serves the connections that sessionListener
// hands it, TLS done, which negotiated h2.
//
// It sends no HTTP/2 pings (SendPingTimeout is 0): a session whose daemon
// went away, or whose connection died silently, is closed by the idle
// timeout (resync, IdleTimeout), and a connection left without a stream by
// the server's idle timeout (HTTPIdleTimeout). Daemons learn that the
// gateway is alive from the acknowledgements of their heartbeats. A ping timer would wake the gateway for every
// connection every SendPingTimeout, thousands of wake-ups a minute for an
// idle fleet (BenchmarkIdleFleet), to learn what heartbeats already say.
func (s *Server) tuneHTTP(srv *http.Server) {
	var p http.Protocols
	p.SetHTTP2(true)
	srv.Protocols = &p
	// A daemon holds one session and up to TunnelsPerNode tunnels; a few
	// more streams cover a reconnect racing the old stream's end.
	streams := s.cfg.TunnelsPerNode + 4
	srv.HTTP2 = &http.HTTP2Config{
		MaxConcurrentStreams:      streams,
		MaxReceiveBufferPerStream: streamWindow,
		// Room for every stream's window: HTTP/2 returns the
		// connection's flow-control credit only as handlers read, so with
		// less, a tunnel whose other end stopped reading would starve the
		// connection's session and other tunnels. A window is only
		// credit: memory is taken by data received and not yet read.
		MaxReceiveBufferPerConnection: streams * streamWindow,
		// Tiny HPACK tables: a session sends one set of headers, so
		// dynamic tables would only hold memory for its lifetime.
		MaxDecoderHeaderTableSize: 1,
		MaxEncoderHeaderTableSize: 1,
	}
	srv.ErrorLog = slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)
}

// streamWindow is the HTTP/2 receive window of each stream of the
// Session server, in bytes.
const streamWindow = 256 << 10

// fence aborts every open stream (not stopping the gateway): it runs when
// last_seen could not be written for store.GatewayFenceAfter, so that the
// gateway stops hearing from nodes before its presence expires (I4).
func (s *Server) fence() {
	s.mu.Lock()
	all := make([]*session, 0, len(s.streams))
	for st := range s.streams {
		all = append(all, st)
	}
	s.mu.Unlock()
	for _, st := range all {
		st.abort(errFenced)
	}
}

// closeAll refuses new streams and tunnels and aborts every open one.
func (s *Server) closeAll() {
	s.closeTunnels()
	s.mu.Lock()
	s.closing = true
	all := make([]*session, 0, len(s.streams))
	for st := range s.streams {
		all = append(all, st)
	}
	s.mu.Unlock()
	for _, st := range all {
		st.abort(errShuttingDown)
	}
}

// sessionCount is how many live sessions the gateway holds (the
// bc.gateway.sessions gauge).
func (s *Server) sessionCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.byNode)
}

// onPoke wakes the sessions a poke names. It runs on the subscription's
// goroutine and never blocks. A poke that names the outbox row it is a copy
// of (store.OutboxIDHeader) wakes them once: the API publishes a command
// batch's poke itself after its commit, and the relay publishes the row
// again; the second copy would make each session claim again and find
// nothing (both come after the commit, so the claim of the first sees the
// batch's commands).
func (s *Server) onPoke(m *nats.Msg) {
	if id := m.Header.Get(store.OutboxIDHeader); id != "" && !s.pokeRows.add(id) {
		return
	}
	var p store.Poke
	if err := json.Unmarshal(m.Data, &p); err != nil {
		s.log.Warn("ignoring malformed poke", "subject", m.Subject, telemetry.KeyError, err)
		return
	}
	s.metrics.pokes.Add(context.Background(), 1, s.metrics.gwAdd...)
	s.mu.Lock()
	wake := make([]*session, 0, len(p.NodeIDs))
	for _, id := range p.NodeIDs {
		if st := s.byNode[id]; st != nil {
			wake = append(wake, st)
		}
	}
	s.mu.Unlock()
	tracePoke(m.Header.Get(telemetry.TraceparentHeader), m.Subject, len(wake))
	for _, st := range wake {
		s.wake(st)
	}
}

// resyncLoop runs resync every ResyncInterval until ctx ends.
func (s *Server) resyncLoop(ctx context.Context) {
	t := s.clk.NewTicker(s.cfg.ResyncInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			s.resync(ctx)
		}
	}
}

// unclosedSession is an ended session still to be cleared in the database.
type unclosedSession struct {
	nodeID, sessionID string
	lastSeen          time.Time
}

// clearSession clears the ended session u in the database (CloseSession,
// which leaves a newer session alone) and reports whether it did; when the
// write fails, u is kept for resync to write again.
func (s *Server) clearSession(ctx context.Context, u unclosedSession) (bool, error) {
	cleared, err := store.CloseSession(ctx, s.db.Pool, s.db.Now(), u.nodeID, u.sessionID, u.lastSeen)
	if err != nil {
		s.mu.Lock()
		s.unclosed = append(s.unclosed, u)
		s.mu.Unlock()
	}
	return cleared, err
}

// retryCloses writes the session closes that failed before again.
func (s *Server) retryCloses(ctx context.Context) {
	s.mu.Lock()
	retry := s.unclosed
	s.unclosed = nil
	s.mu.Unlock()
	for _, u := range retry {
		if ctx.Err() != nil {
			s.mu.Lock()
			s.unclosed = append(s.unclosed, u)
			s.mu.Unlock()
			continue
		}
		if _, err := s.clearSession(ctx, u); err != nil {
			s.log.Warn("clear session again", telemetry.KeyNodeID, u.nodeID, telemetry.KeySessionID, u.sessionID, telemetry.KeyError, err)
		} else {
			s.log.Info("cleared a session whose close had failed", telemetry.KeyNodeID, u.nodeID, telemetry.KeySessionID, u.sessionID)
		}
	}
}

// resync closes silent streams and the sessions whose certificate expired
// (session.expired), forgets the exec tickets that expired,
// writes the session closes that failed again, and re-reads, in one query, the pending work
// of every session this gateway holds: it wakes the sessions whose node has
// queued commands or a spec newer than the session knows, and closes the
// sessions that another session superseded or whose node or certificate (the
// client certificate, or the one renewed on the session) was revoked.
func (s *Server) resync(ctx context.Context) {
	at := s.clk.Now()
	now := at.UnixNano()
	idle := s.cfg.IdleTimeout.Nanoseconds()
	hello := s.cfg.HelloTimeout.Nanoseconds()
	type silentStream struct {
		st  *session
		err error
	}
	var silent, expired []silentStream
	s.mu.Lock()
	for st := range s.streams {
		limit, err := idle, errSilent
		if st.sessionID == "" {
			limit, err = hello, errNoHello
		}
		if now-st.lastRecv.Load() > limit {
			silent = append(silent, silentStream{st, err})
		}
	}
	refs := make([]store.SessionRef, 0, len(s.byNode))
	for id, st := range s.byNode {
		if err := st.expired(at); err != nil {
			expired = append(expired, silentStream{st, err})
			continue
		}
		ref := store.SessionRef{NodeID: id, SessionID: st.sessionID, Serial: st.serial}
		if c := st.cert.Load(); c != nil && c.serial != st.serial {
			ref.Renewed = c.serial
		}
		refs = append(refs, ref)
	}
	s.mu.Unlock()
	for _, x := range silent {
		x.st.abort(x.err)
	}
	for _, x := range expired {
		s.log.Warn("closing a session whose certificate expired", telemetry.KeyNodeID, x.st.nodeID,
			telemetry.KeySessionID, x.st.sessionID, telemetry.KeyError, x.err)
		x.st.abort(x.err)
	}
	s.pruneTickets(s.clk.Now())
	s.retryCloses(ctx)
	if len(refs) == 0 {
		return
	}
	work, err := store.PendingSessionWork(ctx, s.db.Pool, refs)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("resync failed", telemetry.KeyError, err)
		}
		return
	}
	var missed int64
	defer func() {
		if missed > 0 {
			s.metrics.missed.Add(ctx, missed, s.metrics.gwAdd...)
		}
	}()
	for _, w := range work {
		s.mu.Lock()
		st := s.byNode[w.NodeID]
		s.mu.Unlock()
		if st == nil || st.sessionID != w.SessionID {
			continue
		}
		switch {
		case w.Revoked:
			s.log.Warn("closing the session of a revoked node", telemetry.KeyNodeID, w.NodeID, telemetry.KeySessionID, w.SessionID)
			st.abort(errRevoked)
		case w.Superseded:
			st.abort(errSuperseded)
		case w.Queued || w.SpecGeneration > st.known():
			if st.state.Load() == stIdle {
				missed++ // no poke woke it: lost, or still on its way
			}
			s.wake(st)
		}
	}
}

// recentIDs remembers the last recentIDsKept ids added to it. Its zero
// value is ready.
type recentIDs struct {
	mu   sync.Mutex
	set  map[string]struct{}
	ring [recentIDsKept]string
	next int
}

// recentIDsKept is how many outbox row ids onPoke remembers: far more than
// the pokes in flight between a commit's direct copy and the relay's.
const recentIDsKept = 4096

// add records id and reports whether it was not among the ids remembered.
func (r *recentIDs) add(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.set[id]; ok {
		return false
	}
	if r.set == nil {
		r.set = make(map[string]struct{}, recentIDsKept)
	}
	delete(r.set, r.ring[r.next])
	r.ring[r.next] = id
	r.next = (r.next + 1) % recentIDsKept
	r.set[id] = struct{}{}
	return true
}
