package daemon

import (
	"fmt"
	"strings"
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// EffectKind says what an Effect asks the driver to do.
type EffectKind uint8

// The kinds of effect.
const (
	// EffectSend asks the driver to send Msg on session Session. A failed
	// send is reported as Disconnected(Session).
	EffectSend EffectKind = iota + 1
	// EffectDial asks the driver to open session Session to the gateway now
	// and report Connected(Session) once it can send, or
	// Disconnected(Session) if it could not.
	EffectDial
	// EffectClose asks the driver to close session Session (Reason says
	// why). The Agent has already forgotten it: report nothing more for it.
	// Without Abort the driver closes it gracefully: what was sent still
	// reaches the gateway. With Abort the gateway stopped answering (no
	// Welcome in time, or silent for Config.SilenceTimeout): the driver
	// drops the stream at once and closes the connection under it, so that a
	// write blocked on the frozen gateway returns and the next session does
	// not queue behind it.
	EffectClose
	// EffectTimer asks the driver to call Tick at At, replacing any earlier
	// request. A zero At means no timer is needed. Early or extra Tick calls
	// are harmless. Carry out effects first in, first out (effects of an
	// input made while carrying out a batch go after the rest of the batch),
	// so the last EffectTimer seen is current; or ignore EffectTimer and
	// schedule Agent.NextTimer after every batch.
	EffectTimer
	// EffectReboot tells the driver the machine has just rebooted: BootID is
	// the new boot id (a driver may persist the boot counter). The Agent
	// dials again right after.
	EffectReboot
	// EffectMakeCSR asks the driver, when the node certificate is due for
	// renewal, to make a new key pair, keep its private key aside and report
	// a PKCS#10 request for it (DER) with Agent.RenewalCSR, or
	// Agent.RenewalFailed when it cannot. A later EffectMakeCSR replaces
	// the key.
	EffectMakeCSR
	// EffectCertificate gives the driver the node's new certificate
	// (Certificate, DER; valid until NotAfter), issued for the key of the
	// last CSR: the driver stores key and certificate together, atomically,
	// and presents them from the next dial on (the current session goes on
	// with the old ones). It reports Agent.RenewalFailed when it cannot.
	EffectCertificate
	// EffectStop tells the driver the Agent has stopped for good (Reason
	// says why; Status.Stopped matches ErrRevoked or ErrCertificateExpired):
	// the node was revoked or its certificate expired, and the machine must
	// join again. The driver stops driving it and reports it unhealthy.
	EffectStop
	// EffectOpenTunnel asks the driver to open the tunnel the gateway of
	// session Session asked for (Tunnel: its id, purpose "shell" or "ssh",
	// the client terminal's size): dial GatewayService.Tunnel to that same
	// gateway with the node certificate, name the tunnel in its first
	// message (TunnelRequest.start) and serve it (the machine's shell, or a
	// connection to its SSH server) on its own goroutines, never blocking
	// the Agent's caller. The Agent keeps no state of tunnels and reports
	// nothing back for them; the driver ends them when the machine stops or
	// reboots.
	EffectOpenTunnel
)

// String returns the kind's name.
func (k EffectKind) String() string {
	switch k {
	case EffectSend:
		return "send"
	case EffectDial:
		return "dial"
	case EffectClose:
		return "close"
	case EffectTimer:
		return "timer"
	case EffectReboot:
		return "reboot"
	case EffectMakeCSR:
		return "make-csr"
	case EffectCertificate:
		return "certificate"
	case EffectStop:
		return "stop"
	case EffectOpenTunnel:
		return "open-tunnel"
	}
	return fmt.Sprintf("EffectKind(%d)", uint8(k))
}

// Effect is one thing the Agent asks its driver to do. Only the fields of
// its Kind are set.
type Effect struct {
	Kind EffectKind
	// Session is the session number of Send, Dial and Close.
	Session uint64
	// Msg is the message of Send. Treat it as immutable.
	Msg *gatewayv1.SessionRequest
	// At is the wake-up time of Timer.
	At time.Time
	// Reason is why a session is closed (Close), or why the Agent stopped
	// for good (Stop).
	Reason string
	// Abort asks for a hard close (Close): the gateway is not answering.
	Abort bool
	// BootID is the new boot id (Reboot).
	BootID string
	// Certificate is the new node certificate, DER (Certificate). Treat it
	// as immutable.
	Certificate []byte
	// NotAfter is when Certificate expires (Certificate).
	NotAfter time.Time
	// Tunnel is the tunnel to open (OpenTunnel). Treat it as immutable.
	Tunnel *gatewayv1.OpenTunnel
}

// String describes the effect in one stable line (for logs, test failures
// and event logs), e.g. "send[3] update cmd_… SUCCEEDED".
func (e Effect) String() string {
	switch e.Kind {
	case EffectSend:
		return fmt.Sprintf("send[%d] %s", e.Session, DescribeRequest(e.Msg))
	case EffectDial:
		return fmt.Sprintf("dial[%d]", e.Session)
	case EffectClose:
		if e.Abort {
			return fmt.Sprintf("close[%d] abort: %s", e.Session, e.Reason)
		}
		return fmt.Sprintf("close[%d] %s", e.Session, e.Reason)
	case EffectTimer:
		if e.At.IsZero() {
			return "timer none"
		}
		return "timer " + e.At.UTC().Format(time.RFC3339Nano)
	case EffectReboot:
		return "reboot boot=" + e.BootID
	case EffectCertificate:
		return "certificate not_after=" + e.NotAfter.UTC().Format(time.RFC3339Nano)
	case EffectStop:
		return "stop " + e.Reason
	case EffectOpenTunnel:
		return fmt.Sprintf("open-tunnel[%d] %s %s", e.Session, e.Tunnel.GetTunnelId(), e.Tunnel.GetPurpose())
	}
	return e.Kind.String()
}

// DescribeRequest describes a SessionRequest in one stable line.
func DescribeRequest(m *gatewayv1.SessionRequest) string {
	switch {
	case m.GetHello() != nil:
		h := m.GetHello()
		return fmt.Sprintf("hello node=%s boot=%s observed=%d journal=%d", h.GetNodeId(), h.GetBootId(), h.GetObservedGeneration(), len(h.GetJournal()))
	case m.GetHeartbeat() != nil:
		h := m.GetHeartbeat()
		return fmt.Sprintf("heartbeat seq=%d observed=%d", h.GetSeq(), h.GetObservedGeneration())
	case m.GetCommandUpdate() != nil:
		u := m.GetCommandUpdate()
		s := fmt.Sprintf("update %s %s", u.GetCommandId(), strings.TrimPrefix(u.GetState().String(), "COMMAND_STATE_"))
		if u.GetError() != "" {
			s += fmt.Sprintf(" error=%q", u.GetError())
		}
		if r := u.GetResult(); r != nil {
			s += fmt.Sprintf(" gpus=%d output=%d", len(r.GetInventory().GetGpus()), len(r.GetOutput()))
		}
		return s
	case m.GetRenewCertificate() != nil:
		return fmt.Sprintf("renew csr=%dB", len(m.GetRenewCertificate().GetCsrDer()))
	case m.GetReport() != nil:
		r := m.GetReport()
		switch {
		case r.GetAllocationBound() != nil:
			b := r.GetAllocationBound()
			return fmt.Sprintf("bound %s %s gen=%d", b.GetReservationId(), strings.Join(b.GetCdiDevices(), ","), b.GetGeneration())
		case r.GetAllocationUnbound() != nil:
			u := r.GetAllocationUnbound()
			return fmt.Sprintf("unbound %s gen=%d", u.GetReservationId(), u.GetGeneration())
		case r.GetInventory() != nil:
			return fmt.Sprintf("inventory gpus=%d", len(r.GetInventory().GetGpus()))
		case r.GetSpecRefused() != nil:
			sr := r.GetSpecRefused()
			return fmt.Sprintf("spec-refused gen=%d reason=%q", sr.GetGeneration(), sr.GetReason())
		case r.GetSshRefused() != nil:
			sr := r.GetSshRefused()
			return fmt.Sprintf("ssh-refused user=%s key_id=%q reason=%q", sr.GetUser(), sr.GetKeyId(), sr.GetReason())
		default:
			return fmt.Sprintf("observed %d", r.GetObservedGeneration())
		}
	}
	return "empty"
}
