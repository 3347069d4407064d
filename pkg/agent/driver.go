package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

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
	gw     int          // the gateway's index in driver.urls
	url    string       // the gateway's Session URL
	client tunnelClient // the gateway's client, for the session's tunnels
	stream sessionStream
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	queue   []*gatewayv1.SessionRequest // to send, in order
	writing bool                        // a writer goroutine runs
	closing bool                        // half-close once the queue is sent
	ended   bool                        // send nothing more; close the request stream
}

// sessionStream is the daemon's end of a session: sessionwire's
// ClientStream or Connect's BidiStreamForClient.
type sessionStream interface {
	Send(*gatewayv1.SessionRequest) error
	Receive() (*gatewayv1.SessionResponse, error)
	CloseRequest() error
	CloseResponse() error
}

// closeGrace is how long a gracefully closed session may take to end.
const closeGrace = 5 * time.Second

// driver feeds one machine's daemon core from its stream and timer and
// carries out the core's effects. Only loop's goroutine touches it.
type driver struct {
	m    *Machine
	log  *slog.Logger
	clk  clock.Clock
	core *daemon.Agent
	hw   Hardware
	boot uint64 // the boot number (HardwareSpec.Boot, one more per reboot)
	// urls are the gateway replicas' Session URLs and clients one client
	// for each (over the current transport); gw is the index of the
	// gateway the next session goes to. A node moves to the next gateway
	// each time it dials again after its first session, so that a lost
	// gateway costs one backoff, not a wait for it to come back.
	urls    []string
	clients []gatewayv1connect.GatewayServiceClient
	gw      int
	// framed says, for each gateway, whether sessions to it use the
	// framed transport (Config.SessionTransport): set at the start,
	// cleared for a gateway that refuses it.
	framed []bool
	dialed bool
	events chan event
	timer  clock.Timer
	cur    *session
	ctx    context.Context
	conns  *connTracker // the connections of the machine's transports
	rn     renewState   // certificate renewal (renew.go)
	dir    string       // the machine's data directory
	// stopped is set by EffectStop: the machine stopped for good.
	stopped bool
	// tun is the machine's open tunnels (tunnel.go), sshd its SSH server
	// (sshd.go), refusals the logins that server refused, for the core to
	// report.
	tun      tunnelSet
	sshd     *sshServer
	refusals chan *gatewayv1.SshRefused
	// nodeID is the node's id; spans the spans of the commands in flight
	// (trace.go).
	nodeID string
	spans  commandSpans
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
	defer d.waitTunnels()
	d.apply(d.core.Start(d.clk.Now()))
	for !d.stopped {
		select {
		case <-ctx.Done():
			d.m.update(func(s *MachineStatus) { s.State, s.SessionID = daemon.StateIdle, "" })
			return nil
		case ev := <-d.events:
			if ev.err != nil {
				err := classify(ev.err)
				if d.cur != nil && d.cur.n == ev.session {
					if sessionwire.IsUnsupported(ev.err) && d.framed[d.cur.gw] {
						d.framed[d.cur.gw] = false
						d.log.Info("the gateway does not serve the framed session transport: using Connect over HTTP/2",
							"gateway", d.cur.url)
					}
					d.log.Info("session ended", "session", ev.session, telemetry.KeyError, err)
					d.closeSession()
					d.spans.ended()
				}
				d.apply(d.core.Disconnected(d.clk.Now(), ev.session, err))
			} else {
				d.spans.received(ev.msg, d.nodeID)
				d.apply(d.core.Receive(d.clk.Now(), ev.session, ev.msg))
			}
		case <-d.timer.C():
			d.apply(d.core.Tick(d.clk.Now()))
		case r := <-d.refusals:
			d.apply(d.core.ReportSSHRefused(r))
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
			d.spans.sent(e.Msg)
		case daemon.EffectDial:
			d.closeSession()
			d.freshTransport()
			if d.dialed {
				d.gw = (d.gw + 1) % len(d.urls)
			}
			d.dialed = true
			d.open(e.Session)
			effects = append(effects, d.core.Connected(d.clk.Now(), e.Session)...)
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
			d.boot++
			if err := writeBoot(d.m.dir, d.boot); err != nil {
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
		case daemon.EffectOpenTunnel:
			if d.cur == nil || d.cur.n != e.Session {
				d.log.Info("tunnel not opened: its session ended", keyTunnelID, e.Tunnel.GetTunnelId())
				continue
			}
			d.openTunnel(d.cur, e.Tunnel)
		}
	}
	if acc := d.core.SSHAccess(); acc != d.sshd.access.Load() {
		d.sshd.setAccess(acc)
	}
	st := d.core.Status()
	switch st.State {
	case daemon.StateRebooting:
		d.endTunnels("the machine reboots")
	case daemon.StateStopped:
		d.endTunnels("the machine stopped for good")
	}
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

// open starts session n: the stream and its reader goroutine. The stream
// dials, or sends its HTTP/2 request, with the first message (Hello) or
// the reader's first Receive.
func (d *driver) open(n uint64) {
	sctx, cancel := context.WithCancel(d.ctx)
	if len(d.urls) > 1 {
		d.log.Debug("opening session", "session", n, "gateway", d.urls[d.gw])
	}
	var stream sessionStream
	if d.framed[d.gw] {
		stream = sessionwire.NewClientStream(sctx, newDialer(d.conns), dialAddr(d.urls[d.gw]), d.rn.tlsCfg, service.MaxMessageBytes)
	} else {
		stream = d.clients[d.gw].Session(sctx)
	}
	d.cur = &session{n: n, gw: d.gw, url: d.urls[d.gw], client: d.clients[d.gw], stream: stream, ctx: sctx, cancel: cancel}
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
