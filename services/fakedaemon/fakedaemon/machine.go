package fakedaemon

import (
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Machine is the handle of one simulated machine of a Runner. Its methods are
// safe for concurrent use.
type Machine struct {
	r     *Runner
	index int
	dir   string
	log   *slog.Logger

	mu sync.Mutex
	st MachineStatus

	cert clientCert // the node certificate presented at each TLS handshake

	// refusal is the refused Join of a JoinOnly run (set by the Runner).
	refusal *JoinRefusedError
}

// MachineStatus is a snapshot of a machine.
type MachineStatus struct {
	// Index is the machine's index in the Runner (its directory name).
	Index int
	// MachineID is the machine's stable id ("" before it was read).
	MachineID string
	// NodeID is the node id ("" until the machine has joined).
	NodeID string
	// Variant is the machine's fake hardware variant.
	Variant string
	// Joined reports that the machine has a node identity.
	Joined bool
	// State is the daemon core's session state.
	State daemon.State
	// SessionID is the gateway's session id while established.
	SessionID string
	// GatewayID is the id of the gateway holding the session while
	// established (Welcome.gateway_id), else "".
	GatewayID string
	// Silenced counts the sessions the machine dropped because their
	// gateway stopped answering (daemon.Config.SilenceTimeout).
	Silenced int
	// BootID is the machine's current boot id.
	BootID string
	// ObservedGeneration is the NodeSpec generation applied.
	ObservedGeneration int64
	// Sessions counts the sessions that reached Welcome.
	Sessions int
	// CertNotAfter is when the node certificate in use expires.
	CertNotAfter time.Time
	// Renewals counts the certificates renewed over the session and stored
	// since the machine started.
	Renewals int
	// Runs counts the commands the hardware ran (not those answered from
	// the journal) since the machine started: a command delivered twice
	// and run once counts one.
	Runs int
	// Stopped is why the machine stopped for good ("" while it runs): its
	// node was revoked or its certificate expired (daemon.StateStopped), and
	// it must join again. The Runner reports unhealthy while any machine is
	// stopped.
	Stopped string
	// JoinError is why the machine could not join with Config.JoinOnly
	// (e.g. "join refused: join token is used up (2 of 2 uses)"), "" if it
	// joined.
	JoinError string
}

// Index returns the machine's index.
func (m *Machine) Index() int { return m.index }

// Dir returns the machine's data directory.
func (m *Machine) Dir() string { return m.dir }

// Status returns a snapshot of the machine.
func (m *Machine) Status() MachineStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.st
}

// NodeID returns the node id, "" until the machine has joined.
func (m *Machine) NodeID() string { return m.Status().NodeID }

// State returns the session state.
func (m *Machine) State() daemon.State { return m.Status().State }

func (m *Machine) update(f func(*MachineStatus)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f(&m.st)
}

// JoinRefusedError is a Join that JoinService refused for good (bad, expired,
// revoked or used-up token, malformed request). Its message is the server's.
type JoinRefusedError struct {
	// Code is the Connect code of the refusal.
	Code connect.Code
	// Message is the server's message, e.g. "join token is used up (10 of 10
	// uses)".
	Message string
}

// Error returns "join refused: <server message>".
func (e *JoinRefusedError) Error() string { return "join refused: " + e.Message }

// permanent reports whether a Join error will not go away by retrying.
func permanent(code connect.Code) bool {
	switch code {
	case connect.CodePermissionDenied, connect.CodeFailedPrecondition, connect.CodeInvalidArgument,
		connect.CodeUnauthenticated, connect.CodeNotFound, connect.CodeAlreadyExists,
		connect.CodeUnimplemented, connect.CodeOutOfRange:
		return true
	}
	return false
}

// run joins if needed and drives the daemon core until ctx ends.
func (m *Machine) run(ctx context.Context) error {
	if err := os.MkdirAll(m.dir, 0o700); err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	unlock, err := lockDir(m.dir)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	defer unlock()
	id, err := loadIdentity(m.dir)
	if err != nil {
		return fmt.Errorf("machine %d: identity: %w", m.index, err)
	}
	variant := m.r.cfg.Variant
	var machineID string
	pending, err := loadPendingJoin(m.dir)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	if id != nil {
		machineID = id.MachineID
		if id.Variant != "" {
			if id.Variant != variant {
				m.log.Warn("keeping the variant the machine joined with", "variant", id.Variant, "requested", variant)
			}
			variant = id.Variant
		}
	} else if pending != nil {
		machineID = pending.MachineID // stopped mid-join: the same machine
	} else if m.r.cfg.MachineIDSeed != "" {
		machineID = MachineID(m.r.cfg.MachineIDSeed, m.index)
	} else if machineID, err = newMachineID(); err != nil {
		return fmt.Errorf("machine %d: machine id: %w", m.index, err)
	}
	hw, err := fakehw.New(variant, machineID)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	if m.r.cfg.Durations != nil {
		hw.SetDurations(*m.r.cfg.Durations)
	}
	m.update(func(s *MachineStatus) { s.MachineID, s.Variant = machineID, variant })
	// The start that joins is boot 0 and writes nothing but the identity;
	// every later start advances the boot counter on disk.
	var boot uint64
	if id == nil {
		if id, err = m.join(ctx, hw, pending); err != nil {
			return err
		}
	} else if !m.r.cfg.JoinOnly { // joining only is no boot of the machine
		if boot, err = nextBoot(m.dir); err != nil {
			return fmt.Errorf("machine %d: %w", m.index, err)
		}
	}
	log := m.log.With(telemetry.KeyNodeID, id.NodeID)
	hw.SetBoot(boot)
	m.update(func(s *MachineStatus) {
		s.NodeID, s.Joined, s.BootID, s.CertNotAfter = id.NodeID, true, hw.BootID(), id.cert.NotAfter
	})

	if m.r.cfg.JoinOnly {
		return nil
	}

	j, err := openFileJournal(m.dir, m.r.clk.Now(), true)
	if err != nil {
		return fmt.Errorf("machine %d: journal: %w", m.index, err)
	}
	defer j.Close()
	if !j.LostAt().IsZero() {
		log.Warn("journal was lost; commands that may have run before are failed unless retry-safe", "lost_at", j.LostAt(), "epoch", j.Epoch())
	}

	gwURLs, tlsCfg, err := m.gatewayTLS(id)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	conns := newConnTracker()
	tr := newTransport(tlsCfg, conns)
	defer tr.CloseIdleConnections()

	acfg := m.r.cfg.Agent
	acfg.NodeID = id.NodeID
	acfg.AgentVersion = m.r.cfg.AgentVersion
	acfg.Logger = log
	acfg.CertNotBefore, acfg.CertNotAfter = id.cert.NotBefore, id.cert.NotAfter
	// The joined certificate arrived at JoinedAt; a renewed one has a later
	// NotBefore, which then wins (daemon.Config.CertReceivedAt).
	acfg.CertReceivedAt = id.JoinedAt
	acfg.CommandSigningRoot = id.CommandSigningKey()
	seed := sha256.Sum256([]byte(machineID))
	agent, err := daemon.New(acfg, countingHardware{hw, m}, j, rand.New(rand.NewPCG(binary.BigEndian.Uint64(seed[:8]), boot)))
	if err != nil {
		return err
	}
	d := &driver{m: m, log: log, clk: m.r.clk, agent: agent, hw: hw, dir: m.dir,
		events: make(chan event, 16), timer: m.r.clk.NewTimer(time.Hour),
		urls: gwURLs, gw: int(binary.BigEndian.Uint64(seed[8:16]) % uint64(len(gwURLs))),
		conns: conns, rn: renewState{id: id, tlsCfg: tlsCfg, tr: tr}}
	d.makeClients()
	d.timer.Stop()
	log.Info("machine up", "variant", variant, "boot", boot, "gateways", gwURLs)
	return d.loop(ctx)
}

// join makes the node's identity with JoinService, retrying transient
// errors: the token goes sealed to JoinService's key and bound to the CSR,
// and nothing of the response is used before pki.CheckJoinResponse accepted
// it against the pins.
func (m *Machine) join(ctx context.Context, hw *fakehw.Machine, pending *pendingJoin) (*Identity, error) {
	trust, err := m.r.joinTrust(ctx)
	if err != nil {
		return nil, err
	}
	// The key is kept (PendingJoinFile) before the first attempt: a machine
	// stopped before the answer came joins again with it, and JoinService
	// answers with the node that key joined as, if the first attempt got
	// that far, rather than making another.
	var key crypto.Signer
	if pending != nil {
		key = pending.key
	} else {
		if key, err = pki.GenerateKey(); err != nil {
			return nil, fmt.Errorf("machine %d: key: %w", m.index, err)
		}
		if err := savePendingJoin(m.dir, hw.MachineID(), key); err != nil {
			return nil, fmt.Errorf("machine %d: %w", m.index, err)
		}
	}
	csr, err := pki.NewCSR(key, hw.Hostname())
	if err != nil {
		return nil, err
	}
	token, err := m.r.readToken(ctx)
	if err != nil {
		return nil, err
	}
	sealed, err := pki.SealJoinToken(trust.keys.Encryption, token, csr)
	if err != nil {
		return nil, fmt.Errorf("machine %d: seal the join token: %w", m.index, err)
	}
	req := &joinv1.JoinRequest{
		SealedToken: sealed,
		CsrDer:      csr,
		Claims: &joinv1.Claims{
			Hostname:     hw.Hostname(),
			MachineId:    hw.MachineID(),
			AgentVersion: m.r.cfg.AgentVersion,
			Variant:      hw.Variant(),
		},
	}
	var resp *connect.Response[joinv1.JoinResponse]
	for attempt := 1; ; attempt++ {
		select {
		case m.r.joinSem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		resp, err = trust.client.Join(ctx, connect.NewRequest(req))
		<-m.r.joinSem
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var cerr *connect.Error
		if errors.As(err, &cerr) && permanent(cerr.Code()) {
			return nil, &JoinRefusedError{Code: cerr.Code(), Message: cerr.Message()}
		}
		delay := daemon.BackoffCap(m.r.cfg.JoinBackoffMin, m.r.cfg.JoinBackoffMax, attempt)
		delay = delay/2 + time.Duration(rand.Int64N(int64(delay/2)+1))
		m.log.Warn("join failed; retrying", "attempt", attempt, "in", delay.String(), telemetry.KeyError, err)
		if err := clock.Sleep(ctx, m.r.clk, delay); err != nil {
			return nil, err
		}
	}
	msg := resp.Msg
	v, err := pki.CheckJoinResponse(msg, trust.pins, trust.keys.SigningSPKI)
	if err != nil {
		return nil, fmt.Errorf("machine %d: %w", m.index, err)
	}
	if !samePublicKey(v.Certificate, key.Public()) {
		return nil, fmt.Errorf("machine %d: join response: the certificate is not for this machine's key", m.index)
	}
	id := &Identity{
		NodeID:             msg.GetNodeId(),
		MachineID:          hw.MachineID(),
		Variant:            hw.Variant(),
		GatewayURLs:        msg.GetGatewayUrls(),
		GatewayServerName:  msg.GetGatewayServerName(),
		TrustDomain:        msg.GetTrustDomain(),
		PoolID:             msg.GetPoolId(),
		JoinedAt:           m.r.clk.Now().UTC(),
		CommandSigningRoot: msg.GetTrust().GetCommandSigningRoot(),
		key:                key,
		cert:               v.Certificate,
		servingCA:          v.ServingCA,
		commandRoot:        v.CommandSigningRoot,
	}
	if id.NodeID == "" || len(id.GatewayURLs) == 0 {
		return nil, fmt.Errorf("machine %d: join response lacks node_id or gateway_urls", m.index)
	}
	if msg.GetNotAfter() != nil {
		id.NotAfter = msg.GetNotAfter().AsTime()
	}
	// The journal comes first: once the identity is saved, a missing
	// journal is a loss.
	if err := initFileJournal(m.dir); err != nil {
		return nil, fmt.Errorf("machine %d: journal: %w", m.index, err)
	}
	if err := id.save(m.dir, v.NodeCA); err != nil {
		return nil, fmt.Errorf("machine %d: save identity: %w", m.index, err)
	}
	if err := os.Remove(filepath.Join(m.dir, PendingJoinFile)); err != nil {
		return nil, fmt.Errorf("machine %d: %w", m.index, err)
	}
	m.log.Info("joined", telemetry.KeyNodeID, id.NodeID, telemetry.KeyPoolID, id.PoolID,
		"signed_intent", id.commandRoot != nil)
	return id, nil
}

func samePublicKey(cert *x509.Certificate, pub crypto.PublicKey) bool {
	k, ok := pub.(interface{ Equal(x crypto.PublicKey) bool })
	return ok && k.Equal(cert.PublicKey)
}

// countingHardware counts the commands the daemon core runs on the machine
// (MachineStatus.Runs).
type countingHardware struct {
	*fakehw.Machine
	m *Machine
}

// Run runs the command on the fake hardware and counts it.
func (h countingHardware) Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error) {
	h.m.update(func(s *MachineStatus) { s.Runs++ })
	return h.Machine.Run(kind, args)
}

// gatewayTLS returns the gateway URLs (Config override, else the
// identity's) and the mTLS client configuration: the node certificate, the
// serving CA as the only root, and the server name (Config override, else
// the JoinResponse's, else the first URL's host) that every gateway replica
// presents.
func (m *Machine) gatewayTLS(id *Identity) ([]string, *tls.Config, error) {
	urls := id.GatewayURLs
	if m.r.cfg.GatewayURL != "" {
		urls = pki.SplitGatewayURLs(m.r.cfg.GatewayURL)
	}
	if len(urls) == 0 {
		return nil, nil, errors.New("no gateway url")
	}
	// The override was checked by New; the JoinResponse's URLs are checked
	// here.
	for _, raw := range urls {
		if err := pki.CheckGatewayURL(raw); err != nil {
			return nil, nil, err
		}
	}
	first, _ := url.Parse(urls[0])
	firstHost := first.Hostname()
	name := m.r.cfg.GatewayServerName
	if name == "" {
		name = id.GatewayServerName
	}
	if name == "" {
		name = firstHost
	}
	roots := x509.NewCertPool()
	roots.AddCert(id.servingCA)
	m.cert.set(id)
	return urls, &tls.Config{
		// The newest certificate: a renewal replaces it (renew.go).
		GetClientCertificate: m.cert.get,
		RootCAs:              roots,
		ServerName:           name,
		MinVersion:           tls.VersionTLS12,
		NextProtos:           []string{"h2"},
	}, nil
}

// newTransport returns an HTTP/2-only transport for one machine, whose
// connections conns tracks. A gateway that acknowledges heartbeats and
// stops answering is noticed by the daemon core (daemon.Config
// SilenceTimeout, 15 s), which has the driver close the connection. Below
// that, the transport notices a connection that died silently within 25 s:
// on Linux by the heartbeats it cannot deliver (TCP_USER_TIMEOUT,
// transport_linux.go), elsewhere by an HTTP/2 ping after 15 s without a
// frame; those are what notice a hung gateway that does not acknowledge
// heartbeats (an older one), the ping within 70 s.
func newTransport(tlsCfg *tls.Config, conns *connTracker) *http.Transport {
	var p http.Protocols
	p.SetHTTP2(true)
	return &http.Transport{
		Protocols:       &p,
		TLSClientConfig: tlsCfg,
		DialContext: conns.wrap((&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second,
			Control: dialControl}).DialContext),
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConns:        1,
		IdleConnTimeout:     90 * time.Second,
		HTTP2: &http.HTTP2Config{
			SendPingTimeout: pingIdle,
			PingTimeout:     10 * time.Second,
		},
	}
}

// event is something the stream reader saw on a session.
type event struct {
	session uint64
	msg     *gatewayv1.SessionResponse
	err     error // the stream ended
}

// session is the driver's side of one Session stream. The driver's loop
// never blocks on it: a reader goroutine turns what arrives into events, and
// what the loop sends goes through a queue to a writer goroutine, started
// when there is something to send and gone when the queue is empty, the
// only caller of Send and CloseRequest while it runs. So a gateway that
// stops reading (its HTTP/2 window spent, the TCP send buffer full) cannot
// stall the loop, and the daemon core's silence timeout still fires and
// drops the session.
type session struct {
	n      uint64
	url    string // the gateway's Session URL
	stream *connect.BidiStreamForClient[gatewayv1.SessionRequest, gatewayv1.SessionResponse]
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	queue   []*gatewayv1.SessionRequest // to send, in order
	writing bool                        // a writer goroutine runs
	closing bool                        // half-close once the queue is sent
	ended   bool                        // send nothing more; close the request stream
}

// closeGrace is how long a gracefully closed session may take to end.
const closeGrace = 5 * time.Second

// driver feeds one machine's daemon core from its stream and timer and
// carries out the core's effects. Only loop's goroutine touches it.
type driver struct {
	m     *Machine
	log   *slog.Logger
	clk   clock.Clock
	agent *daemon.Agent
	hw    *fakehw.Machine
	// urls are the gateway replicas' Session URLs and clients one client
	// for each (over the current transport); gw is the index of the
	// gateway the next session goes to. A node moves to the next gateway
	// each time it dials again after its first session, so that a lost
	// gateway costs one backoff, not a wait for it to come back.
	urls    []string
	clients []gatewayv1connect.GatewayServiceClient
	gw      int
	dialed  bool
	events  chan event
	timer   clock.Timer
	cur     *session
	ctx     context.Context
	conns   *connTracker // the connections of the machine's transports
	rn      renewState   // certificate renewal (renew.go)
	dir     string       // the machine's data directory
	// stopped is set by EffectStop: the machine stopped for good.
	stopped bool
}

// revokedMessage is the message of the gateway's Unauthenticated refusal of
// a revoked node or certificate (services/gateway: errRevoked).
const revokedMessage = "certificate revoked"

// classify marks a session error that is a revocation (Connect
// Unauthenticated "certificate revoked", at Session start or closing an
// established session) with daemon.ErrRevoked, which stops the daemon core
// for good, and reports a connection that dropped mid-stream (the gateway
// was killed) as Unavailable "lost the connection to the gateway: …"
// (service.ConnectionLost); other errors are returned as they are.
func classify(err error) error {
	var cerr *connect.Error
	if errors.As(err, &cerr) && cerr.Code() == connect.CodeUnauthenticated && strings.Contains(cerr.Message(), revokedMessage) {
		return fmt.Errorf("%w: %w", daemon.ErrRevoked, err)
	}
	return service.ConnectionLost(err, "the gateway")
}

func (d *driver) loop(ctx context.Context) error {
	d.ctx = ctx
	defer d.closeTransports()
	defer d.closeSession()
	defer d.timer.Stop()
	d.apply(d.agent.Start(d.clk.Now()))
	for !d.stopped {
		select {
		case <-ctx.Done():
			d.m.update(func(s *MachineStatus) { s.State, s.SessionID = daemon.StateIdle, "" })
			return nil
		case ev := <-d.events:
			if ev.err != nil {
				err := classify(ev.err)
				if d.cur != nil && d.cur.n == ev.session {
					d.log.Info("session ended", "session", ev.session, telemetry.KeyError, err)
					d.closeSession()
				}
				d.apply(d.agent.Disconnected(d.clk.Now(), ev.session, err))
			} else {
				d.apply(d.agent.Receive(d.clk.Now(), ev.session, ev.msg))
			}
		case <-d.timer.C():
			d.apply(d.agent.Tick(d.clk.Now()))
		}
	}
	// Stopped for good: the other machines and the health endpoint go on;
	// this one stays down (unhealthy) until it joins again.
	return nil
}

// apply carries out effects in order; effects caused by failures (a failed
// send) are carried out after them.
func (d *driver) apply(effects []daemon.Effect) {
	for len(effects) > 0 {
		e := effects[0]
		effects = effects[1:]
		switch e.Kind {
		case daemon.EffectSend:
			if d.cur == nil || d.cur.n != e.Session {
				continue
			}
			// A failed send comes back as an event (write).
			d.send(d.cur, e.Msg)
		case daemon.EffectDial:
			d.closeSession()
			d.freshTransport()
			if d.dialed {
				d.gw = (d.gw + 1) % len(d.urls)
			}
			d.dialed = true
			d.open(e.Session)
			effects = append(effects, d.agent.Connected(d.clk.Now(), e.Session)...)
		case daemon.EffectClose:
			if d.cur != nil && d.cur.n == e.Session {
				if e.Abort {
					d.abortSession(e.Reason)
				} else {
					d.log.Info("closing session", "session", e.Session, "reason", e.Reason)
					d.closeGracefully()
				}
			}
		case daemon.EffectTimer:
			d.timer.Stop()
			if !e.At.IsZero() {
				d.timer.Reset(max(e.At.Sub(d.clk.Now()), 0))
			}
		case daemon.EffectReboot:
			d.log.Info("rebooted", "boot_id", e.BootID)
			if err := writeBoot(d.m.dir, d.hw.Boot()); err != nil {
				d.log.Warn("could not persist the boot counter", telemetry.KeyError, err)
			}
		case daemon.EffectMakeCSR, daemon.EffectCertificate:
			effects = append(effects, d.renewEffect(e)...)
		case daemon.EffectStop:
			// The core logged the reason as an error; say how to join again.
			d.log.Error("this machine stopped for good and must join again: remove its identity to join with a new join token",
				"identity", filepath.Join(d.dir, NodeFile), "reason", e.Reason)
			d.closeSession()
			d.timer.Stop()
			d.stopped = true
		}
	}
	st := d.agent.Status()
	d.m.update(func(s *MachineStatus) {
		if st.State == daemon.StateEstablished && s.State != daemon.StateEstablished {
			s.Sessions++
		}
		s.State, s.SessionID, s.BootID, s.ObservedGeneration = st.State, st.SessionID, st.BootID, st.ObservedGeneration
		s.GatewayID, s.Silenced = st.GatewayID, st.Silenced
		if st.Stopped != nil {
			s.Stopped = st.Stopped.Error()
		}
	})
}

// open starts session n: the stream and its reader goroutine.
// The HTTP/2 request goes out with the first message (Hello).
func (d *driver) open(n uint64) {
	sctx, cancel := context.WithCancel(d.ctx)
	if len(d.urls) > 1 {
		d.log.Debug("opening session", "session", n, "gateway", d.urls[d.gw])
	}
	stream := d.clients[d.gw].Session(sctx)
	d.cur = &session{n: n, url: d.urls[d.gw], stream: stream, ctx: sctx, cancel: cancel}
	go func() {
		defer cancel()
		defer func() { _ = stream.CloseResponse() }()
		for {
			msg, err := stream.Receive()
			select {
			case d.events <- event{session: n, msg: msg, err: err}:
			case <-sctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
}

// makeClients makes one Session client per gateway URL over the current
// transport.
func (d *driver) makeClients() {
	d.clients = d.clients[:0]
	for _, u := range d.urls {
		d.clients = append(d.clients, gatewayv1connect.NewGatewayServiceClient(&http.Client{Transport: d.rn.tr}, u, d.m.r.clientOpts...))
	}
}

// send queues m on s and starts a writer unless one runs.
func (d *driver) send(s *session, m *gatewayv1.SessionRequest) {
	s.mu.Lock()
	s.queue = append(s.queue, m)
	start := !s.writing
	s.writing = true
	s.mu.Unlock()
	if start {
		go d.write(s)
	}
}

// write is session s's writer: it sends what the loop queued, in order,
// until the queue is empty, the stream fails or s ended. Once s ended it
// closes the request stream (net/http's HTTP/2 client does not watch the
// context while it reads the request body, so a cancelled stream ends only
// once its body ends); once s is closing, it half-closes it (halfClose). A
// send that fails ends s and reports the session ended, unless the stream
// ended (io.EOF): the reader reports why.
func (d *driver) write(s *session) {
	for {
		s.mu.Lock()
		batch := s.queue
		s.queue = nil
		if len(batch) == 0 || s.ended {
			s.writing = false
			ended, closing := s.ended, s.closing
			s.mu.Unlock()
			switch {
			case ended:
				_ = s.stream.CloseRequest()
			case closing:
				d.halfClose(s)
			}
			return
		}
		s.mu.Unlock()
		for _, m := range batch {
			if err := s.stream.Send(m); err != nil {
				d.log.Debug("send failed", "session", s.n, telemetry.KeyError, err)
				s.mu.Lock()
				s.ended, s.writing, s.queue = true, false, nil
				s.mu.Unlock()
				_ = s.stream.CloseRequest()
				if !errors.Is(err, io.EOF) {
					select {
					case d.events <- event{session: s.n, err: err}:
					case <-s.ctx.Done():
					}
				}
				return
			}
		}
	}
}

// end ends s: gracefully, the request stream is half-closed once what was
// queued is sent (halfClose); otherwise s is cancelled and its request
// stream closed, by its writer if one runs.
func (d *driver) end(s *session, graceful bool) {
	s.mu.Lock()
	if graceful {
		s.closing = true
	} else {
		s.ended = true
	}
	idle := !s.writing
	s.writing = true // nothing is sent on s any more: this is its last writer
	s.mu.Unlock()
	if !graceful {
		s.cancel()
	}
	switch {
	case !idle:
	case graceful:
		go d.halfClose(s)
	default:
		_ = s.stream.CloseRequest()
	}
}

// halfClose ends s's request stream, so that what was sent before (a
// reboot's SUCCEEDED) still reaches the gateway, and aborts s if the
// gateway has not ended it within closeGrace.
func (d *driver) halfClose(s *session) {
	if err := s.stream.CloseRequest(); err != nil {
		s.cancel()
		return
	}
	t := d.clk.NewTimer(closeGrace)
	defer t.Stop()
	select {
	case <-t.C():
	case <-s.ctx.Done(): // the reader saw the end, or the machine stops
	}
	s.cancel()
}

// closeSession aborts the current session's stream, if any.
func (d *driver) closeSession() {
	if d.cur == nil {
		return
	}
	d.end(d.cur, false)
	d.cur = nil
}

// closeGracefully half-closes the current session once what was queued is
// sent.
func (d *driver) closeGracefully() {
	if d.cur == nil {
		return
	}
	d.end(d.cur, true)
	d.cur = nil
}

// abortSession drops the current session at once because its gateway
// stopped answering (daemon.EffectClose with Abort): the stream is
// cancelled and every connection to that gateway closed, so that a write
// blocked on it returns and the next session to it dials afresh. The next
// session goes to the next gateway (EffectDial).
func (d *driver) abortSession(reason string) {
	s := d.cur
	d.cur = nil
	d.end(s, false)
	closed := d.conns.closeAddr(dialAddr(s.url))
	d.log.Info("dropped the session: the gateway stopped answering", "session", s.n, "gateway", s.url,
		"reason", reason, "connections_closed", closed)
}
