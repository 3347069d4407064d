package gateway

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

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

// Reasons of a refused renewal (CertificateIssued.error); an expired
// session certificate is sessionCertExpired, a renewal too soon
// renewRateLimited.
const (
	renewRevoked     = "certificate revoked"
	renewUnknownCert = "the session's client certificate is not known"
	renewFailed      = "the gateway could not issue the certificate; retry later"
)

// renewRateLimited is the reason of a renewal refused because the node's
// newest certificate was recorded at last, less than every ago: the next one
// may be issued from last+every.
func renewRateLimited(last time.Time, every time.Duration) string {
	return fmt.Sprintf("renewal rate limited: the node was issued a certificate at %s and gets at most one per %s; renew at or after %s",
		last.UTC().Format(time.RFC3339), every, last.Add(every).UTC().Format(time.RFC3339))
}

// renew answers a RenewCertificate: the answer goes out with the session's
// next delivery, and the session goes on whatever the outcome.
func (s *Server) renew(ctx context.Context, st *session, r *gatewayv1.RenewCertificate) {
	st.issued.Store(s.issue(ctx, st, r.GetCsrDer()))
	s.wake(st)
}

// issue signs csrDER with the node CA for the session's node, valid for
// NodeCertTTL, and records the certificate in node_certs, in one transaction
// that first locks the node so that a concurrent RevokeNode cannot be
// missed, nor a concurrent renewal of the node. It refuses a CSR that does
// not parse or is not signed by its key; a revoked node, client certificate
// or certificate renewed on the session; an expired session certificate
// (session.cert: the client certificate, or the last one renewed on the
// session); and a renewal within RenewInterval of the node's newest
// certificate. The issued certificate becomes the session's, extending it
// to its NotAfter.
func (s *Server) issue(ctx context.Context, st *session, csrDER []byte) *gatewayv1.CertificateIssued {
	csr, err := pki.ParseCSR(csrDER)
	if err != nil {
		s.log.WarnContext(ctx, "renewal refused: bad CSR", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		return &gatewayv1.CertificateIssued{Error: "renew_certificate.csr_der: " + err.Error()}
	}
	sc := st.cert.Load()
	var (
		cert    *x509.Certificate
		refusal string
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		cert, refusal = nil, ""
		now := s.db.Now()
		cur, err := store.LockSessionCert(ctx, tx, st.serial)
		if refusal, err = renewRefusal(st, cur, err); refusal != "" || err != nil {
			return err
		}
		if sc.serial != st.serial {
			renewed, err := store.GetSessionCert(ctx, tx, sc.serial)
			if refusal, err = renewRefusal(st, renewed, err); refusal != "" || err != nil {
				return err
			}
		}
		if !now.Before(sc.notAfter) {
			refusal = sessionCertExpired(sc.notAfter)
			return nil
		}
		last, err := store.LastNodeCertCreatedAt(ctx, tx, st.nodeID)
		if err != nil {
			return err
		}
		if now.Before(last.Add(s.cfg.RenewInterval)) {
			refusal = renewRateLimited(last, s.cfg.RenewInterval)
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
	st.cert.Store(&sessionCert{serial: pki.SerialHex(cert), notAfter: cert.NotAfter})
	s.log.InfoContext(ctx, "certificate renewed", telemetry.KeyNodeID, st.nodeID, "cert_serial", pki.SerialHex(cert),
		"not_after", cert.NotAfter)
	return &gatewayv1.CertificateIssued{CertificateDer: cert.Raw, NotAfter: timestamppb.New(cert.NotAfter)}
}

// renewRefusal says why a renewal on st may not rest on cert, a
// certificate of the session as store.LockSessionCert or GetSessionCert
// returned it (cert, err): unknown, another node's, revoked. It returns ""
// when it may, and a database error as its second result.
func renewRefusal(st *session, cert store.SessionCert, err error) (string, error) {
	switch {
	case errors.Is(err, store.ErrNotFound) || (err == nil && cert.NodeID != st.nodeID):
		return renewUnknownCert, nil
	case err != nil:
		return "", err
	case cert.RevokedAt != nil:
		return renewRevoked, nil
	}
	return "", nil
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
	ref := decodeSSHRefused(st.nodeID, r)
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
