package joinservice

import (
	"bytes"
	"crypto/x509"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/pki"
)

// fuzzNodeID is the node of FuzzRenewNodeCertificate's renewals.
const fuzzNodeID = "node_01JFUZZ000000000000000000"

// FuzzRenewNodeCertificate feeds arbitrary bytes, decoded as a
// RenewNodeCertificateRequest, through every check of a renewal before the
// database (decodeRenewal) and, for one it accepts, the node CA's signature:
// nothing may panic; a refusal is InvalidArgument naming a field; an
// accepted request has a session certificate of the node CA for its node and
// a proof by that certificate's key, and its certificate is for the CSR's key
// and names only the node.
func FuzzRenewNodeCertificate(f *testing.F) {
	now := time.Date(2030, 5, 6, 7, 8, 9, 0, time.UTC)
	ca, err := pki.NewCA("fuzz node CA", now.Add(-time.Hour), 24*time.Hour)
	if err != nil {
		f.Fatal(err)
	}
	s := &Server{nodeCA: ca, trustDomain: "fuzz.test"}
	sessionKey, err := pki.GenerateKey()
	if err != nil {
		f.Fatal(err)
	}
	sessionCSR, err := pki.NewCSR(sessionKey, fuzzNodeID)
	if err != nil {
		f.Fatal(err)
	}
	parsed, err := pki.ParseCSR(sessionCSR)
	if err != nil {
		f.Fatal(err)
	}
	session, err := ca.IssueNode(parsed, fuzzNodeID, "fuzz.test", now, time.Hour)
	if err != nil {
		f.Fatal(err)
	}
	key, err := pki.GenerateKey()
	if err != nil {
		f.Fatal(err)
	}
	csr, err := pki.NewCSR(key, fuzzNodeID)
	if err != nil {
		f.Fatal(err)
	}
	proof, err := pki.SignRenewal(sessionKey, session, csr)
	if err != nil {
		f.Fatal(err)
	}
	valid := &joinv1.RenewNodeCertificateRequest{NodeId: fuzzNodeID, ClientCertSerial: pki.SerialHex(session),
		SessionCertDer: session.Raw, CsrDer: csr, Proof: proof}
	if _, err := s.decodeRenewal(valid); err != nil {
		f.Fatalf("the valid seed was refused: %v", err)
	}
	for _, seed := range []*joinv1.RenewNodeCertificateRequest{
		valid,
		{NodeId: fuzzNodeID, ClientCertSerial: "0a", SessionCertDer: session.Raw, CsrDer: csr},
		{NodeId: fuzzNodeID, ClientCertSerial: "0a", SessionCertDer: session.Raw, CsrDer: csr[:len(csr)-1], Proof: proof},
		{NodeId: "node_other", ClientCertSerial: "0a", SessionCertDer: session.Raw, CsrDer: csr, Proof: proof},
		{},
	} {
		b, err := proto.Marshal(seed)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}

	f.Fuzz(func(t *testing.T, b []byte) {
		var msg joinv1.RenewNodeCertificateRequest
		if err := proto.Unmarshal(b, &msg); err != nil {
			return // Connect refuses a message that does not decode
		}
		in, err := s.decodeRenewal(&msg)
		if err != nil {
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("decodeRenewal: %v", err)
			}
			return
		}
		if err := in.session.CheckSignatureFrom(ca.Cert); err != nil {
			t.Fatalf("accepted a session certificate the node CA did not sign: %v", err)
		}
		if id, err := pki.NodeIDFromCert(in.session, "fuzz.test"); err != nil || id != msg.GetNodeId() || in.nodeID != id {
			t.Fatalf("accepted a session certificate of %q (%v) for node %q", id, err, msg.GetNodeId())
		}
		if err := pki.VerifyRenewal(in.session, msg.GetCsrDer(), msg.GetProof()); err != nil {
			t.Fatalf("accepted a proof that does not verify: %v", err)
		}
		cert, err := ca.IssueNode(in.csr, in.nodeID, "fuzz.test", now, time.Hour)
		if err != nil {
			t.Fatalf("a CSR decodeRenewal accepted cannot be signed: %v", err)
		}
		requireRenewedCert(t, ca, cert, in.csr, in.nodeID)
	})
}

// requireRenewedCert checks that cert, issued by ca for csr, is for the
// CSR's key and names only node id.
func requireRenewedCert(t *testing.T, ca *pki.CA, cert *x509.Certificate, csr *x509.CertificateRequest, id string) {
	t.Helper()
	if err := cert.CheckSignatureFrom(ca.Cert); err != nil {
		t.Fatalf("renewed certificate not signed by the node CA: %v", err)
	}
	if !bytes.Equal(cert.RawSubjectPublicKeyInfo, csr.RawSubjectPublicKeyInfo) {
		t.Fatal("renewed certificate is not for the CSR's key")
	}
	if got, err := pki.NodeIDFromCert(cert, "fuzz.test"); err != nil || got != id || len(cert.URIs) != 1 ||
		len(cert.DNSNames)+len(cert.IPAddresses)+len(cert.EmailAddresses) != 0 {
		t.Fatalf("renewed certificate names %v %v %v %v (%v), want only node %s", cert.URIs, cert.DNSNames, cert.IPAddresses,
			cert.EmailAddresses, err, id)
	}
}
