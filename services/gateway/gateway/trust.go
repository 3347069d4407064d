package gateway

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// refusedPrefix starts the error of a command a daemon refused (signedIntent;
// see pkg/daemon ErrTextCommandUnsigned).
const refusedPrefix = "refused: "

// renewFailed is the reason of a renewal that JoinService did not decide
// (unreachable, failed, or a request it could not take): the daemon retries
// with backoff.
const renewFailed = "the gateway could not issue the certificate; retry later"

// renewCallTimeout bounds one NodeCertService call of a renewal.
const renewCallTimeout = 10 * time.Second

// renewBusy is the reason of a RenewCertificate sent while the session's
// previous one is still being decided (a daemon sends one at a time).
const renewBusy = "a renewal of this session is in progress; retry later"

// renew answers a RenewCertificate: JoinService decides it (issue) on a
// goroutine of its own, so that the session's messages and heartbeats go
// on meanwhile, and the answer goes out with the session's next delivery.
// The session goes on whatever the outcome.
func (s *Server) renew(st *session, r *gatewayv1.RenewCertificate) {
	if !st.renewing.CompareAndSwap(false, true) {
		st.issued.Store(&gatewayv1.CertificateIssued{Error: renewBusy})
		s.wake(st)
		return
	}
	s.renewals.Go(func() {
		ci := s.issue(st.ctx, st, r)
		// Done before the answer can be sent: a daemon that renews again
		// as soon as it has the answer is not told one is in progress.
		st.renewing.Store(false)
		st.issued.Store(ci)
		s.wake(st)
	})
}

// issue has JoinService decide and sign the renewal r of st's node
// (bc.join.v1.NodeCertService/RenewNodeCertificate; JoinService holds the
// node CA): it forwards the CSR and the daemon's proof with the session's
// client certificate serial and the certificate the session rests on
// (session.cert: the client certificate, or the last one renewed on the
// session). A refusal's reason (FailedPrecondition, ResourceExhausted, and
// InvalidArgument of the CSR or the proof, named as fields of
// renew_certificate) goes to the daemon as it is; any other failure is
// renewFailed. The issued certificate becomes the session's, extending it
// to its NotAfter.
func (s *Server) issue(ctx context.Context, st *session, r *gatewayv1.RenewCertificate) *gatewayv1.CertificateIssued {
	sc := st.cert.Load()
	ctx, cancel := context.WithTimeout(ctx, renewCallTimeout)
	defer cancel()
	resp, err := s.nodeCerts.RenewNodeCertificate(ctx, connect.NewRequest(&joinv1.RenewNodeCertificateRequest{
		NodeId: st.nodeID, ClientCertSerial: st.serial, SessionCertDer: sc.cert.Raw,
		CsrDer: r.GetCsrDer(), Proof: r.GetProof(),
	}))
	var cert *x509.Certificate
	if err == nil {
		if cert, err = x509.ParseCertificate(resp.Msg.GetCertificateDer()); err != nil {
			err = fmt.Errorf("JoinService's certificate: %w", err)
		}
	}
	if err != nil {
		if reason, ok := renewRefusal(err); ok {
			s.log.WarnContext(ctx, "renewal refused", telemetry.KeyNodeID, st.nodeID, "cert_serial", sc.serial, "reason", reason)
			return &gatewayv1.CertificateIssued{Error: reason}
		}
		if st.ctx.Err() == nil {
			s.log.ErrorContext(ctx, "renew certificate", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		}
		return &gatewayv1.CertificateIssued{Error: renewFailed}
	}
	st.cert.Store(&sessionCert{serial: pki.SerialHex(cert), notAfter: cert.NotAfter, cert: cert})
	s.log.InfoContext(ctx, "certificate renewed", telemetry.KeyNodeID, st.nodeID, "cert_serial", pki.SerialHex(cert),
		"not_after", cert.NotAfter)
	return &gatewayv1.CertificateIssued{CertificateDer: cert.Raw, NotAfter: timestamppb.New(cert.NotAfter)}
}

// renewRefusal returns the reason a daemon gets for JoinService's error err
// when err is a refusal of its renewal (nodecert.proto), and false when it
// is not (the control plane's failure, or a request the gateway got
// wrong).
func renewRefusal(err error) (string, bool) {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return "", false
	}
	switch ce.Code() {
	case connect.CodeFailedPrecondition, connect.CodeResourceExhausted:
		return ce.Message(), true
	case connect.CodeInvalidArgument:
		if m := ce.Message(); strings.HasPrefix(m, "csr_der: ") || strings.HasPrefix(m, "proof: ") {
			return "renew_certificate." + m, true
		}
	}
	return "", false
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
