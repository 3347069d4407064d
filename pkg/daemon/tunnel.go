package daemon

import (
	"slices"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// The node's part of tunnels (docs/architecture.md, "Tunnels"): the Agent
// hands each OpenTunnel of its established session to the driver
// (EffectOpenTunnel), keeps what the node's SSH server accepts logins
// against (SSHAccess, from the applied NodeSpec), and reports the logins that
// server refused (ReportSSHRefused). It keeps no state of open tunnels: the
// driver serves them, and ends them with the machine.

// maxTunnelID is the longest tunnel id a TunnelStart carries
// (bc.gateway.v1.TunnelStart.tunnel_id).
const maxTunnelID = 64

// MaxPendingSSHRefusals is how many SSH refusals the Agent keeps while it
// has no established session, to report after the next Welcome; older ones
// are dropped (and were logged by the driver).
const MaxPendingSSHRefusals = 16

// ErrTextSpecBadSSHCA starts the SpecRefused reason of a desired state whose
// SSH user CAs do not parse or are not the deployment's two
// (sshca.Authorities); the parse error follows.
const ErrTextSpecBadSSHCA = "refused: the desired state's ssh_user_cas are unusable"

// SSHAccess is what the node's SSH server accepts logins against
// (sshca.Authorize): the SSH user CAs and the reservations of the NodeSpec
// the Agent applied. The Agent makes a new one whenever that changes and
// never changes one it returned, so it may be shared with other goroutines
// (the SSH server's) as it is.
type SSHAccess struct {
	// Authorities are the spec's SSH user CAs; none before a spec was
	// applied, and none after a spec whose CAs did not parse was refused
	// (trust fails closed: the control plane meant to change it).
	Authorities []sshca.Authority
	// Reservations are the reservation ids of the spec's allocations, sorted.
	Reservations []string
}

// HasReservation reports whether reservation id is in the spec
// (sshca.Login.Reservations).
func (s *SSHAccess) HasReservation(id string) bool {
	_, ok := slices.BinarySearch(s.Reservations, id)
	return ok
}

// noAccess is the SSHAccess of an Agent that applied no spec: no CA, no
// reservation.
var noAccess = &SSHAccess{}

// SSHAccess returns what the node's SSH server accepts logins against now
// (never nil). The result is immutable; the Agent returns a new one after it
// applied a spec that changed it (compare pointers to notice).
func (a *Agent) SSHAccess() *SSHAccess { return a.access }

// openTunnel hands an OpenTunnel to the driver (EffectOpenTunnel) when it
// came on the established session and names a tunnel and a purpose the node
// serves; others are logged and ignored (the gateway gives up on a tunnel
// the node does not dial back).
func (a *Agent) openTunnel(o *out, t *gatewayv1.OpenTunnel) {
	id, purpose := t.GetTunnelId(), t.GetPurpose()
	var why string
	switch {
	case a.state != StateEstablished:
		why = "the session is not established (no Welcome yet)"
	case id == "" || len(id) > maxTunnelID:
		why = "the tunnel id is empty or too long"
	case purpose != tunnel.PurposeShell && purpose != tunnel.PurposeSSH:
		why = "unknown purpose"
	}
	if why != "" {
		a.cfg.Logger.Warn("OpenTunnel ignored", "tunnel.id", id, "purpose", purpose, "reason", why)
		return
	}
	o.add(Effect{Kind: EffectOpenTunnel, Session: a.session, Tunnel: t})
}

// ReportSSHRefused reports a login the node's SSH server refused
// (Report.ssh_refused, which the gateway records as node.ssh_refused): on
// the established session at once, else after the next Welcome (the latest
// MaxPendingSSHRefusals are kept). A stopped Agent reports nothing.
func (a *Agent) ReportSSHRefused(r *gatewayv1.SshRefused) []Effect {
	var o out
	switch a.state {
	case StateStopped:
	case StateEstablished:
		a.send(&o, sshRefusedOf(r))
	default:
		if len(a.sshRefusals) == MaxPendingSSHRefusals {
			a.sshRefusals = slices.Delete(a.sshRefusals, 0, 1)
		}
		a.sshRefusals = append(a.sshRefusals, r)
	}
	return a.finish(&o)
}

func sshRefusedOf(r *gatewayv1.SshRefused) *gatewayv1.SessionRequest {
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
		Report: &gatewayv1.Report_SshRefused{SshRefused: r},
	}}}
}

// sendSSHRefusals sends the refusals kept while there was no session.
func (a *Agent) sendSSHRefusals(o *out) {
	for _, r := range a.sshRefusals {
		a.send(o, sshRefusedOf(r))
	}
	a.sshRefusals = nil
}

// specAccess returns the SSHAccess of a spec with authorities applied with
// allocations allocs (sorted by reservation id): the current one when
// nothing changed.
func (a *Agent) specAccess(authorities []sshca.Authority, allocs []allocation) *SSHAccess {
	ids := make([]string, len(allocs))
	for i, al := range allocs {
		ids[i] = al.reservationID
	}
	if slices.Equal(ids, a.access.Reservations) && sameAuthorities(authorities, a.access.Authorities) {
		return a.access
	}
	if len(ids) == 0 && len(authorities) == 0 {
		return noAccess
	}
	return &SSHAccess{Authorities: authorities, Reservations: ids}
}

func sameAuthorities(x, y []sshca.Authority) bool {
	return slices.EqualFunc(x, y, func(p, q sshca.Authority) bool {
		return p.Name == q.Name && string(p.Key.Marshal()) == string(q.Key.Marshal())
	})
}
