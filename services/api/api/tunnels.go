package api

// TunnelService (docs/architecture.md, "Tunnels"): exec tickets for the
// tunnels of tunnel_ws.go, and SSH user certificates, both after the same
// check of who may reach which node (checkAccess).

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// TunnelsPath is where tunnels open (GET TunnelsPath + ticket, a
// WebSocket; tunnel_ws.go): CreateTicketResponse.path.
const TunnelsPath = PathPrefix + "/tunnels/"

// tunnelKeys are what tunnels need from the PKI directory: the
// tunnel-ticket key (pki.TunnelTicketKey), which signs exec tickets and
// whose public key verifies them when they come back; the SSH user CAs;
// and the TLS settings of https:// gateway control URLs (the serving CA,
// pki.ServingCACert, as root).
type tunnelKeys struct {
	ticketKey  ed25519.PrivateKey
	ticketPub  ed25519.PublicKey
	breakGlass *sshca.CA
	sandbox    *sshca.CA
	gatewayTLS *tls.Config
}

// loadTunnelKeys reads the tunnel keys of PKI directory dir. Errors name
// the file that is missing or broken.
func loadTunnelKeys(dir string) (*tunnelKeys, error) {
	key, err := pki.LoadSigningKey(filepath.Join(dir, pki.TunnelTicketKey))
	if err != nil {
		return nil, fmt.Errorf("tunnel-ticket key: %w", err)
	}
	k := &tunnelKeys{ticketKey: key, ticketPub: key.Public().(ed25519.PublicKey)}
	if k.breakGlass, err = sshca.LoadCA(dir, sshca.BreakGlass); err != nil {
		return nil, fmt.Errorf("ssh %s CA: %w", sshca.BreakGlass, err)
	}
	if k.sandbox, err = sshca.LoadCA(dir, sshca.Sandbox); err != nil {
		return nil, fmt.Errorf("ssh %s CA: %w", sshca.Sandbox, err)
	}
	roots := x509.NewCertPool()
	pem, err := os.ReadFile(filepath.Join(dir, pki.ServingCACert))
	if err != nil {
		return nil, fmt.Errorf("gateways' serving CA: %w", err)
	}
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificate", filepath.Join(dir, pki.ServingCACert))
	}
	k.gatewayTLS = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS13}
	return k, nil
}

// errTunnelsOff is the refusal of every tunnel call of an API without a
// PKI directory.
var errTunnelsOff = errors.New("tunnels are not configured: the API has no PKI directory (" + config.Prefix + "PKI_DIR)")

// tunnelsConfigured returns the tunnel keys, or FailedPrecondition when the
// API has none.
func (s *Server) tunnelsConfigured() (*tunnelKeys, error) {
	if s.keys == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errTunnelsOff)
	}
	return s.keys, nil
}

type tunnelService struct{ *Server }

// nodeAccess is what lets a caller reach a node: the node, and for a
// sandbox the reservation it comes through.
type nodeAccess struct {
	node store.Node
	// res is the sandbox's reservation; nil for a shell or break-glass SSH.
	res *store.Reservation
}

// accessError is why a caller may not reach a node: its Connect code, the
// message of the RPC that asked (naming the request's field), and the
// reason an open tunnel closes with when its re-authorization meets it.
type accessError struct {
	code      connect.Code
	msg       string
	tunnelMsg string
}

func (e *accessError) Error() string { return e.msg }

// rpcError is e as the RPCs answer it.
func (e *accessError) rpcError() error { return connect.NewError(e.code, errors.New(e.msg)) }

// checkAccess decides whether p may reach node nodeID at now: with
// reservationID "" as root (a shell, break-glass SSH), which needs
// iam.PermNodesAccess and a node in p's scope; otherwise the sandbox of that
// reservation, which needs iam.PermReservationsWrite and a reservation in
// p's scope that is active on that node and not past its end. Either way
// the node must be adopted and not revoked. The sandbox's node is read
// through the reservation (its pool may be another tenant's, offered to
// p's): the reservation, read in p's scope, names it. A node or
// reservation outside p's scope reads as missing (NotFound). It returns an
// *accessError for a refusal, other errors for the database's.
func checkAccess(ctx context.Context, q store.DBTX, p iam.Principal, nodeID, reservationID string, now time.Time) (nodeAccess, error) {
	if reservationID == "" {
		if !p.Can(iam.PermNodesAccess) {
			return nodeAccess{}, &accessError{code: connect.CodePermissionDenied,
				msg: fmt.Sprintf("role %s may not open a shell or break-glass SSH on a node (needs %s); "+
					"set reservation_id for the sandbox of a reservation", p.Role, iam.PermNodesAccess),
				tunnelMsg: fmt.Sprintf("role %s may no longer reach the node (needs %s)", p.Role, iam.PermNodesAccess)}
		}
		n, err := store.GetNode(ctx, q, p.Scope(), nodeID)
		if errors.Is(err, store.ErrNotFound) {
			msg := "node " + nodeID + " not found"
			return nodeAccess{}, &accessError{code: connect.CodeNotFound, msg: msg, tunnelMsg: msg}
		}
		if err != nil {
			return nodeAccess{}, err
		}
		return nodeAccess{node: n}, checkNodeState(n)
	}
	if !p.Can(iam.PermReservationsWrite) {
		return nodeAccess{}, &accessError{code: connect.CodePermissionDenied,
			msg:       fmt.Sprintf("role %s may not reach a reservation's sandbox (needs %s)", p.Role, iam.PermReservationsWrite),
			tunnelMsg: fmt.Sprintf("role %s may no longer reach the reservation's sandbox (needs %s)", p.Role, iam.PermReservationsWrite)}
	}
	r, err := store.GetReservation(ctx, q, p.Scope(), reservationID)
	if errors.Is(err, store.ErrNotFound) {
		return nodeAccess{}, &accessError{code: connect.CodeNotFound, msg: "reservation_id: reservation " + reservationID + " not found",
			tunnelMsg: "reservation " + reservationID + " not found"}
	}
	if err != nil {
		return nodeAccess{}, err
	}
	gone := "reservation " + reservationID + " is no longer active"
	if r.NodeID != nodeID {
		// A node the caller cannot see stays unseen: NotFound, as if the
		// reservation were not the question.
		if _, err := store.GetNode(ctx, q, p.Scope(), nodeID); errors.Is(err, store.ErrNotFound) {
			msg := "node " + nodeID + " not found"
			return nodeAccess{}, &accessError{code: connect.CodeNotFound, msg: msg, tunnelMsg: msg}
		} else if err != nil {
			return nodeAccess{}, err
		}
		return nodeAccess{}, &accessError{code: connect.CodeFailedPrecondition,
			msg: "reservation_id: reservation " + reservationID + " is not on node " + nodeID, tunnelMsg: gone}
	}
	switch {
	case r.State != store.ReservationActive:
		return nodeAccess{}, &accessError{code: connect.CodeFailedPrecondition,
			msg: fmt.Sprintf("reservation_id: reservation %s is %s, not active", reservationID, r.State), tunnelMsg: gone}
	case !now.Before(r.EndAt):
		return nodeAccess{}, &accessError{code: connect.CodeFailedPrecondition,
			msg:       fmt.Sprintf("reservation_id: reservation %s ended at %s", reservationID, r.EndAt.UTC().Format(time.RFC3339)),
			tunnelMsg: gone}
	}
	n, err := store.GetNode(ctx, q, store.AllTenants, nodeID)
	if err != nil {
		return nodeAccess{}, err
	}
	return nodeAccess{node: n, res: &r}, checkNodeState(n)
}

// checkNodeState refuses (FailedPrecondition) a node that is revoked or not
// adopted; nil for a node whose tunnels may open (an *accessError type
// would make a nil of it non-nil: it returns error).
func checkNodeState(n store.Node) error {
	switch {
	case n.RevokedAt != nil:
		why := ""
		if n.RevokeReason != "" {
			why = ": " + n.RevokeReason
		}
		return &accessError{code: connect.CodeFailedPrecondition, msg: "node_id: node " + n.ID + " is revoked" + why,
			tunnelMsg: "node was revoked" + why}
	case n.ProvisionState != store.NodeAdopted:
		return &accessError{code: connect.CodeFailedPrecondition,
			msg:       fmt.Sprintf("node_id: node %s is not adopted (it is %s)", n.ID, n.ProvisionState),
			tunnelMsg: fmt.Sprintf("node is not adopted (it is %s)", n.ProvisionState)}
	}
	return nil
}

// rpcAccessError is err of checkAccess as the RPCs answer it.
func rpcAccessError(err error) error {
	var ae *accessError
	if errors.As(err, &ae) {
		return ae.rpcError()
	}
	return err
}

// CreateTicket issues an exec ticket for one tunnel of purpose to node_id
// (with reservation_id: that reservation's sandbox, purpose ssh only), after
// checkAccess: it writes the tunnel_tickets row and the audit row in one
// transaction and returns the ticket signed with the tunnel-ticket key,
// valid tunnel.TicketTTL (whole seconds), and its path. Errors:
// FailedPrecondition (no PKI directory; the node is revoked or not adopted;
// the reservation is not active on the node), PermissionDenied (a role
// without nodes.access and no reservation_id), NotFound (node_id,
// reservation_id), InvalidArgument (reservation_id with purpose shell).
func (s *tunnelService) CreateTicket(ctx context.Context, req *connect.Request[computev1.CreateTicketRequest]) (*connect.Response[computev1.CreateTicketResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	keys, err := s.tunnelsConfigured()
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if msg.ReservationId != "" && msg.Purpose != tunnel.PurposeSSH {
		return nil, connect.NewError(connect.CodeInvalidArgument,
			errors.New("reservation_id: only an ssh tunnel reaches a reservation's sandbox; a shell is root's (purpose shell without reservation_id)"))
	}
	var (
		signed string
		t      tunnel.Ticket
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		now := s.db.Now()
		if _, err := checkAccess(ctx, tx, p, msg.NodeId, msg.ReservationId, now); err != nil {
			return rpcAccessError(err)
		}
		// The ticket carries whole seconds; the row expires with it.
		t = tunnel.Ticket{ID: ids.New(ids.Ticket, now), NodeID: msg.NodeId, Purpose: msg.Purpose, TenantID: p.TenantID,
			TokenID: p.TokenID, ReservationID: msg.ReservationId, ExpiresAt: now.Add(tunnel.TicketTTL).Truncate(time.Second)}
		if err := store.CreateTunnelTicket(ctx, tx, store.TunnelTicket{ID: t.ID, NodeID: t.NodeID, Purpose: t.Purpose,
			TenantID: t.TenantID, TokenID: t.TokenID, ReservationID: t.ReservationID, CreatedAt: now, ExpiresAt: t.ExpiresAt}); err != nil {
			return err
		}
		var err error
		if signed, err = tunnel.Sign(keys.ticketKey, t); err != nil {
			return err
		}
		what := "break-glass"
		switch {
		case t.Purpose == tunnel.PurposeShell:
			what = "shell"
		case t.ReservationID != "":
			what = "sandbox of " + t.ReservationID
		}
		return s.auditInTx(ctx, tx, msg.NodeId, fmt.Sprintf("%s ticket %s (%s), expires %s", t.Purpose, t.ID, what,
			t.ExpiresAt.UTC().Format(time.RFC3339)))
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "tunnel ticket issued", "ticket.id", t.ID, telemetry.KeyNodeID, t.NodeID, "purpose", t.Purpose,
		"reservation.id", t.ReservationID, "api_token.id", t.TokenID)
	return connect.NewResponse(&computev1.CreateTicketResponse{Ticket: signed, TicketId: t.ID,
		ExpiresAt: timestamppb.New(t.ExpiresAt), Path: TunnelsPath + signed}), nil
}

// IssueSshCertificate signs an OpenSSH user certificate for public_key,
// after checkAccess: without reservation_id from the break-glass CA for
// principal root, with it from the sandbox CA for the reservation's id,
// valid for ttl (default sshca.DefaultTTL; protovalidate keeps it at most
// sshca.MaxTTL), a sandbox's no later than its reservation's end; bound to
// the node (sshca.NodeOption), its key id naming the caller's token and the
// node. It writes the audit row with the serial, key id, principals and
// validity. Errors: InvalidArgument (public_key, ttl), and those of
// CreateTicket.
func (s *tunnelService) IssueSshCertificate(ctx context.Context, req *connect.Request[computev1.IssueSshCertificateRequest]) (*connect.Response[computev1.IssueSshCertificateResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	keys, err := s.tunnelsConfigured()
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	key, err := sshca.ParseUserKey(msg.PublicKey)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("public_key: %w", err))
	}
	ttl := sshca.DefaultTTL
	if msg.Ttl != nil {
		ttl = msg.Ttl.AsDuration()
	}
	if ttl < time.Second {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("ttl: at least 1s (a certificate's validity is whole seconds)"))
	}
	var res *computev1.IssueSshCertificateResponse
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		now := s.db.Now()
		access, err := checkAccess(ctx, tx, p, msg.NodeId, msg.ReservationId, now)
		if err != nil {
			return rpcAccessError(err)
		}
		ca, principal, keyID := keys.breakGlass, sshca.RootPrincipal, p.TokenID+" for "+msg.NodeId
		until := now.Add(ttl)
		if access.res != nil {
			ca, principal = keys.sandbox, access.res.ID
			keyID += ", reservation " + access.res.ID
			until = minTime(until, access.res.EndAt)
		}
		cert, err := ca.Issue(sshca.Request{Key: key, NodeID: msg.NodeId, Principal: principal, KeyID: keyID,
			ValidBefore: until}, now)
		if err != nil {
			return err
		}
		after, before := time.Unix(int64(cert.ValidAfter), 0).UTC(), time.Unix(int64(cert.ValidBefore), 0).UTC()
		res = &computev1.IssueSshCertificateResponse{Certificate: sshca.MarshalPublicKey(cert), Serial: cert.Serial,
			KeyId: cert.KeyId, Principals: cert.ValidPrincipals, ValidAfter: timestamppb.New(after),
			ValidBefore: timestamppb.New(before), Ca: ca.Name}
		return s.auditInTx(ctx, tx, msg.NodeId, fmt.Sprintf("%s certificate serial %d, key id %q, principals %s, valid %s to %s",
			ca.Name, cert.Serial, cert.KeyId, strings.Join(cert.ValidPrincipals, ","), after.Format(time.RFC3339),
			before.Format(time.RFC3339)))
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "ssh certificate issued", telemetry.KeyNodeID, msg.NodeId, "ca", res.Ca, "serial", res.Serial,
		"key_id", res.KeyId)
	return connect.NewResponse(res), nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
