package joinservice

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"time"

	"buf.build/go/protovalidate"
	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Renewal: the gateways relay the RenewCertificate of a daemon's session to
// NodeCertService on JoinService's control listener (mutual TLS, the
// gateways' certificates), and JoinService, the one holder of the node CA's
// key, decides it and signs (nodecert.proto).

// DefaultRenewInterval is Config.RenewInterval when unset, unless a tenth of
// NodeCertTTL is less.
const DefaultRenewInterval = 10 * time.Minute

// Reasons of a refused renewal (RenewNodeCertificate's error messages, which
// the gateway passes on as CertificateIssued.error); an expired session
// certificate is sessionCertExpired, a renewal too soon renewRateLimited.
const (
	renewRevoked     = "certificate revoked"
	renewUnknownCert = "the session's client certificate is not known"
)

// sessionCertExpired is why a renewal on a session whose certificate
// expired at notAfter is refused (the gateway closes such a session with the
// same words).
func sessionCertExpired(notAfter time.Time) string {
	return "the session's certificate expired at " + notAfter.UTC().Format(time.RFC3339) +
		": reconnect with a renewed certificate, or join again"
}

// renewRateLimited is the reason of a renewal refused because the node's
// newest certificate was recorded at last, less than every ago: the next one
// may be issued from last+every.
func renewRateLimited(last time.Time, every time.Duration) string {
	return fmt.Sprintf("renewal rate limited: the node was issued a certificate at %s and gets at most one per %s; renew at or after %s",
		last.UTC().Format(time.RFC3339), every, last.Add(every).UTC().Format(time.RFC3339))
}

// checkRenewInterval fills cfg.RenewInterval's default and refuses one above
// a quarter of NodeCertTTL.
func checkRenewInterval(cfg *Config) error {
	if cfg.RenewInterval <= 0 {
		cfg.RenewInterval = min(DefaultRenewInterval, cfg.NodeCertTTL/10)
	}
	if cfg.RenewInterval > cfg.NodeCertTTL/4 {
		return &config.Error{Name: config.Prefix + "NODE_CERT_RENEW_INTERVAL", Err: fmt.Errorf(
			"%s is above a quarter of %sNODE_CERT_TTL (%s): a renewal whose answer was lost could not be retried before the certificate expires",
			cfg.RenewInterval, config.Prefix, cfg.NodeCertTTL)}
	}
	return nil
}

// controlTLS is the control listener's TLS configuration: JoinService's
// serving certificate, and client certificates required, verified against
// the serving CA for the ClientAuth usage (crypto/tls checks it), so that
// only the gateways call NodeCertService.
func controlTLS(cert tls.Certificate, servingCA *x509.Certificate) *tls.Config {
	pool := x509.NewCertPool()
	pool.AddCert(servingCA)
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientCAs:    pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		NextProtos:   []string{"h2"},
		MinVersion:   tls.VersionTLS13,
	}
}

// ControlHandler returns the mux of the control listener: NodeCertService.
// It expects requests over the mutual TLS of the control listener.
func (s *Server) ControlHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(joinv1connect.NewNodeCertServiceHandler(nodeCertService{s}, service.HandlerOptions(s.logger)...))
	return mux
}

// ControlTLSConfig returns the control listener's TLS configuration (mutual
// TLS, h2 only). Do not modify it.
func (s *Server) ControlTLSConfig() *tls.Config { return s.controlTLS }

// nodeCertService implements NodeCertService on a Server.
type nodeCertService struct{ s *Server }

var _ joinv1connect.NodeCertServiceHandler = nodeCertService{}

// RenewNodeCertificate implements bc.join.v1.NodeCertService; see the proto
// for its refusals.
func (n nodeCertService) RenewNodeCertificate(ctx context.Context, req *connect.Request[joinv1.RenewNodeCertificateRequest]) (
	*connect.Response[joinv1.RenewNodeCertificateResponse], error) {
	cert, err := n.s.renew(ctx, req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&joinv1.RenewNodeCertificateResponse{CertificateDer: cert.Raw,
		NotAfter: timestamppb.New(cert.NotAfter)}), nil
}

// refusal is a renewal refused with code and reason.
func refusal(code connect.Code, reason string) error {
	return connect.NewError(code, errors.New(reason))
}

// renewal is what decodeRenewal took from a RenewNodeCertificateRequest.
type renewal struct {
	nodeID, clientSerial string
	// session is the session's certificate, its signature by the node CA
	// and its node checked; its serial is sessionSerial.
	session       *x509.Certificate
	sessionSerial string
	csr           *x509.CertificateRequest
}

// decodeRenewal runs every check of a renewal that needs no database:
// protovalidate; the session certificate is one the node CA signed for the
// node of the request (its expiry is checked by renew, with a reason of its
// own); the CSR parses and is signed by its key; and the proof verifies with
// the session certificate's key. Errors are InvalidArgument naming the field.
func (s *Server) decodeRenewal(msg *joinv1.RenewNodeCertificateRequest) (renewal, error) {
	if err := protovalidate.Validate(msg); err != nil {
		return renewal{}, connect.NewError(connect.CodeInvalidArgument, err)
	}
	sc, err := x509.ParseCertificate(msg.GetSessionCertDer())
	if err != nil {
		return renewal{}, refusal(connect.CodeInvalidArgument, "session_cert_der: "+err.Error())
	}
	if err := sc.CheckSignatureFrom(s.nodeCA.Cert); err != nil {
		return renewal{}, refusal(connect.CodeInvalidArgument, "session_cert_der: not signed by the node CA")
	}
	if id, err := pki.NodeIDFromCert(sc, s.trustDomain); err != nil || id != msg.GetNodeId() {
		return renewal{}, refusal(connect.CodeInvalidArgument, "session_cert_der: not a certificate of node "+msg.GetNodeId())
	}
	csr, err := pki.ParseCSR(msg.GetCsrDer())
	if err != nil {
		return renewal{}, refusal(connect.CodeInvalidArgument, "csr_der: "+err.Error())
	}
	if err := pki.VerifyRenewal(sc, msg.GetCsrDer(), msg.GetProof()); err != nil {
		return renewal{}, refusal(connect.CodeInvalidArgument, "proof: "+err.Error())
	}
	return renewal{nodeID: msg.GetNodeId(), clientSerial: msg.GetClientCertSerial(), session: sc,
		sessionSerial: pki.SerialHex(sc), csr: csr}, nil
}

// renew decides a renewal and, when it may, signs the CSR with the node CA
// for the request's node, valid for NodeCertTTL, and records the certificate
// in node_certs, in one transaction that first locks the node (through the
// client certificate's row) so that a concurrent RevokeNode cannot be
// missed, nor a concurrent renewal of the node. Past decodeRenewal's checks,
// it refuses a revoked node, client certificate or session certificate; a
// client or session certificate that node_certs does not hold for the node;
// an expired session certificate; and a renewal within RenewInterval of the
// node's newest certificate. Errors are *connect.Error.
func (s *Server) renew(ctx context.Context, msg *joinv1.RenewNodeCertificateRequest) (*x509.Certificate, error) {
	in, err := s.decodeRenewal(msg)
	if err != nil {
		s.logger.WarnContext(ctx, "renewal refused", telemetry.KeyNodeID, msg.GetNodeId(), "reason", err.Error())
		return nil, err
	}
	var (
		cert   *x509.Certificate
		refuse error
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		cert, refuse = nil, nil
		now := s.db.Now()
		cur, err := store.LockSessionCert(ctx, tx, in.clientSerial)
		if refuse, err = renewRefusal(in.nodeID, cur, err); refuse != nil || err != nil {
			return err
		}
		if in.sessionSerial != in.clientSerial {
			renewed, err := store.GetSessionCert(ctx, tx, in.sessionSerial)
			if refuse, err = renewRefusal(in.nodeID, renewed, err); refuse != nil || err != nil {
				return err
			}
		}
		if !now.Before(in.session.NotAfter) {
			refuse = refusal(connect.CodeFailedPrecondition, sessionCertExpired(in.session.NotAfter))
			return nil
		}
		last, err := store.LastNodeCertCreatedAt(ctx, tx, in.nodeID)
		if err != nil {
			return err
		}
		if now.Before(last.Add(s.cfg.RenewInterval)) {
			refuse = refusal(connect.CodeResourceExhausted, renewRateLimited(last, s.cfg.RenewInterval))
			return nil
		}
		c, err := s.nodeCA.IssueNode(in.csr, in.nodeID, s.trustDomain, now, s.cfg.NodeCertTTL)
		if err != nil {
			return err
		}
		if err := store.CreateNodeCert(ctx, tx, store.NewNodeCert{
			Serial: pki.SerialHex(c), NodeID: in.nodeID, PublicKeySHA256: pki.PublicKeySHA256(c),
			NotBefore: c.NotBefore, NotAfter: c.NotAfter, CreatedAt: now,
		}); err != nil {
			return err
		}
		cert = c
		return nil
	})
	switch {
	case err != nil:
		return nil, s.mapError(ctx, err)
	case refuse != nil:
		s.logger.WarnContext(ctx, "renewal refused", telemetry.KeyNodeID, in.nodeID, "cert_serial", in.sessionSerial,
			"reason", refuse.Error())
		return nil, refuse
	}
	s.issued.Add(1)
	s.logger.InfoContext(ctx, "certificate renewed", telemetry.KeyNodeID, in.nodeID, "cert_serial", pki.SerialHex(cert),
		"not_after", cert.NotAfter)
	return cert, nil
}

// renewRefusal says why a renewal of node nodeID may not rest on cert, a
// certificate of its session as store.LockSessionCert or GetSessionCert
// returned it (cert, err): unknown, another node's, revoked. It returns nil
// when it may, and a database error as its second result.
func renewRefusal(nodeID string, cert store.SessionCert, err error) (error, error) {
	switch {
	case errors.Is(err, store.ErrNotFound) || (err == nil && cert.NodeID != nodeID):
		return refusal(connect.CodeFailedPrecondition, renewUnknownCert), nil
	case err != nil:
		return nil, err
	case cert.RevokedAt != nil:
		return refusal(connect.CodeFailedPrecondition, renewRevoked), nil
	}
	return nil, nil
}
