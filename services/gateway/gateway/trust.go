package gateway

import (
	"context"
	"crypto/x509"
	"errors"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// refusedPrefix starts the error of a command a daemon refused (signedIntent;
// see pkg/daemon ErrTextCommandUnsigned).
const refusedPrefix = "refused: "

// Reasons of a refused renewal (CertificateIssued.error).
const (
	renewRevoked     = "certificate revoked"
	renewUnknownCert = "the session's client certificate is not known"
	renewFailed      = "the gateway could not issue the certificate; retry later"
)

// renew answers a RenewCertificate: the answer goes out with the session's
// next delivery, and the session goes on whatever the outcome.
func (s *Server) renew(ctx context.Context, st *session, r *gatewayv1.RenewCertificate) {
	st.issued.Store(s.issue(ctx, st, r.GetCsrDer()))
	s.wake(st)
}

// issue signs csrDER with the node CA for the session's node, valid for
// NodeCertTTL, and records the certificate in node_certs, in one transaction
// that first locks the node so that a concurrent RevokeNode cannot be
// missed. It refuses a CSR that does not parse or is not signed by its key,
// and a node or session certificate that is revoked.
func (s *Server) issue(ctx context.Context, st *session, csrDER []byte) *gatewayv1.CertificateIssued {
	csr, err := pki.ParseCSR(csrDER)
	if err != nil {
		s.log.WarnContext(ctx, "renewal refused: bad CSR", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		return &gatewayv1.CertificateIssued{Error: "renew_certificate.csr_der: " + err.Error()}
	}
	var (
		cert    *x509.Certificate
		refusal string
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		cert, refusal = nil, ""
		now := s.db.Now()
		cur, err := store.LockSessionCert(ctx, tx, st.serial)
		switch {
		case errors.Is(err, store.ErrNotFound) || (err == nil && cur.NodeID != st.nodeID):
			refusal = renewUnknownCert
			return nil
		case err != nil:
			return err
		case cur.RevokedAt != nil:
			refusal = renewRevoked
			return nil
		}
		c, err := s.cfg.NodeCA.IssueNode(csr, st.nodeID, s.cfg.TrustDomain, now, s.cfg.NodeCertTTL)
		if err != nil {
			return err
		}
		if err := store.CreateNodeCert(ctx, tx, store.NewNodeCert{
			Serial: pki.SerialHex(c), NodeID: st.nodeID, PublicKeySHA256: pki.PublicKeySHA256(c),
			NotBefore: c.NotBefore, NotAfter: c.NotAfter, CreatedAt: now,
		}); err != nil {
			return err
		}
		cert = c
		return nil
	})
	switch {
	case err != nil:
		if ctx.Err() == nil {
			s.log.ErrorContext(ctx, "renew certificate", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		}
		return &gatewayv1.CertificateIssued{Error: renewFailed}
	case refusal != "":
		s.log.WarnContext(ctx, "renewal refused", telemetry.KeyNodeID, st.nodeID, "cert_serial", st.serial, "reason", refusal)
		return &gatewayv1.CertificateIssued{Error: refusal}
	}
	s.log.InfoContext(ctx, "certificate renewed", telemetry.KeyNodeID, st.nodeID, "cert_serial", pki.SerialHex(cert),
		"not_after", cert.NotAfter)
	return &gatewayv1.CertificateIssued{CertificateDer: cert.Raw, NotAfter: timestamppb.New(cert.NotAfter)}
}

// specRefused records that the daemon refused a DesiredState (signedIntent)
// as a node.spec_refused event.
func (s *Server) specRefused(ctx context.Context, st *session, r *gatewayv1.SpecRefused) error {
	s.log.WarnContext(ctx, "the daemon refused a desired state", telemetry.KeyNodeID, st.nodeID,
		"spec_generation", r.GetGeneration(), "reason", r.GetReason())
	if err := store.RecordSpecRefused(ctx, s.db.Pool, s.db.Now(), st.nodeID, r.GetGeneration(), r.GetReason()); err != nil {
		if ctx.Err() == nil {
			s.log.Error("record spec refusal", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		}
		return errRecord
	}
	return nil
}

// sshRefused records that the node's SSH server refused a login as a
// node.ssh_refused event (store.RecordSSHRefused), written at once as spec
// refusals are. The report's strings are within gateway.proto's bounds and
// free of control characters: Server.receive refused the message otherwise.
func (s *Server) sshRefused(ctx context.Context, st *session, r *gatewayv1.SshRefused) error {
	ref := store.SSHRefusal{NodeID: st.nodeID, Reason: r.GetReason(), KeyID: r.GetKeyId(), User: r.GetUser()}
	s.log.WarnContext(ctx, "the node's SSH server refused a login", telemetry.KeyNodeID, st.nodeID, "reason", ref.Reason,
		"key_id", ref.KeyID, "user", ref.User)
	if err := store.RecordSSHRefused(ctx, s.db.Pool, s.db.Now(), ref); err != nil {
		if ctx.Err() == nil {
			s.log.Error("record ssh refusal", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		}
		return errRecord
	}
	return nil
}
