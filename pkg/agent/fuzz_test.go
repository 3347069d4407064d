package agent

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/pki"
)

// FuzzJoinResponse feeds arbitrary bytes, decoded as a JoinResponse, to
// checkJoinResponse, everything a machine checks of JoinService's answer
// before it uses any of it. With resign false the bytes are checked as
// they came: only a response the deployment's join signing key signed (one
// of the seeds) may be accepted. With resign true the fuzzer's response is
// signed first, as a buggy or compromised JoinService would sign anything,
// so that the checks of its content are explored: an accepted response
// still carries the pinned serving CA, a certificate for the machine's key
// (signed by the node CA it carries, if any), a command-signing root that
// matches its pin, a node id and gateway URLs, and the identity is made of
// exactly those. A refusal returns no identity.
func FuzzJoinResponse(f *testing.F) {
	now := time.Date(2030, 5, 6, 7, 8, 9, 0, time.UTC)
	dir := f.TempDir()
	if _, err := pki.Init(dir, pki.InitOptions{}, now); err != nil {
		f.Fatal(err)
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	pins, err := pki.ReadPinsFile(p(pki.PinsJSON))
	if err != nil {
		f.Fatal(err)
	}
	signKey, err := pki.LoadSigningKey(p(pki.JoinSigningKey))
	if err != nil {
		f.Fatal(err)
	}
	_, signSPKI, err := pki.ReadJoinPublicKeys(dir)
	if err != nil {
		f.Fatal(err)
	}
	nodeCA, err := pki.LoadCA(p(pki.NodeCACert), p(pki.NodeCAKey))
	if err != nil {
		f.Fatal(err)
	}
	servingCA, err := pki.LoadCert(p(pki.ServingCACert))
	if err != nil {
		f.Fatal(err)
	}
	_, commandSPKI, err := pki.LoadPublicKey(p(pki.CommandSigningPub))
	if err != nil {
		f.Fatal(err)
	}
	otherSignKey, err := pki.GenerateSigningKey()
	if err != nil {
		f.Fatal(err)
	}
	key, err := pki.GenerateKey()
	if err != nil {
		f.Fatal(err)
	}
	otherKey, err := pki.GenerateKey()
	if err != nil {
		f.Fatal(err)
	}
	// certFor is a node certificate for k, as JoinService issues it.
	certFor := func(k crypto.Signer) *x509.Certificate {
		der, err := pki.NewCSR(k, "machine")
		if err != nil {
			f.Fatal(err)
		}
		csr, err := pki.ParseCSR(der)
		if err != nil {
			f.Fatal(err)
		}
		cert, err := nodeCA.IssueNode(csr, "node_01JFUZZ000000000000000000", pki.DefaultTrustDomain, now, time.Hour)
		if err != nil {
			f.Fatal(err)
		}
		return cert
	}
	cert := certFor(key)
	full := &joinv1.JoinResponse{
		NodeId: "node_01JFUZZ000000000000000000", CertificateDer: cert.Raw, NodeCaDer: nodeCA.Cert.Raw,
		GatewayUrls: []string{"https://gw-a:8443", "https://gw-b:8443"}, GatewayServerName: "gw.example", ServingCaDer: servingCA.Raw,
		TrustDomain: pki.DefaultTrustDomain, NotAfter: timestamppb.New(cert.NotAfter), PoolId: "pool_01JFUZZ000000000000000000",
		Trust: &joinv1.Trust{CommandSigningRoot: commandSPKI},
	}
	bare := &joinv1.JoinResponse{NodeId: full.NodeId, CertificateDer: cert.Raw, GatewayUrls: full.GatewayUrls, ServingCaDer: servingCA.Raw}
	forOther := proto.CloneOf(full)
	forOther.CertificateDer = certFor(otherKey).Raw
	noNode := proto.CloneOf(full)
	noNode.NodeId = ""
	noGateway := proto.CloneOf(full)
	noGateway.GatewayUrls = nil
	wrongCA := proto.CloneOf(full)
	wrongCA.ServingCaDer = nodeCA.Cert.Raw
	// signed are the responses the deployment's key signed: the only ones
	// that may be accepted as they come.
	var signed []*joinv1.JoinResponse
	for _, r := range []*joinv1.JoinResponse{full, bare, forOther, noNode, noGateway, wrongCA} {
		s := proto.CloneOf(r)
		if err := pki.SignJoinResponse(signKey, s); err != nil {
			f.Fatal(err)
		}
		signed = append(signed, s)
	}
	byOther := proto.CloneOf(full)
	if err := pki.SignJoinResponse(otherSignKey, byOther); err != nil {
		f.Fatal(err)
	}
	tampered := proto.CloneOf(signed[0])
	tampered.PoolId = "pool_other"
	for _, r := range append(append([]*joinv1.JoinResponse{}, signed...), full, byOther, tampered, &joinv1.JoinResponse{}) {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, false)
		f.Add(b, true)
	}
	// The valid seed is accepted: the target can tell good from bad.
	if _, _, err := checkJoinResponse(signed[0], pins, signSPKI, key.Public()); err != nil {
		f.Fatalf("the signed seed was refused: %v", err)
	}

	f.Fuzz(func(t *testing.T, b []byte, resign bool) {
		var msg joinv1.JoinResponse
		if err := proto.Unmarshal(b, &msg); err != nil {
			return // Connect refuses an answer that does not decode
		}
		if resign {
			if err := pki.SignJoinResponse(signKey, &msg); err != nil {
				t.Fatal(err)
			}
		}
		id, ca, err := checkJoinResponse(&msg, pins, signSPKI, key.Public())
		if err != nil {
			if id != nil || ca != nil {
				t.Fatalf("an identity and an error: %v", err)
			}
			return
		}
		if !resign && !containsMessage(signed, &msg) {
			t.Fatalf("accepted a response the join signing key did not sign: %v", &msg)
		}
		if err := pki.VerifyJoinResponse(&msg, pins.JoinSigning, signSPKI); err != nil {
			t.Fatalf("accepted a response whose signature does not verify: %v", err)
		}
		if id.NodeID == "" || id.NodeID != msg.GetNodeId() || len(id.GatewayURLs) == 0 ||
			!slices.Equal(id.GatewayURLs, msg.GetGatewayUrls()) || id.PoolID != msg.GetPoolId() || id.TrustDomain != msg.GetTrustDomain() {
			t.Fatalf("identity %+v is not the response's %v", id, &msg)
		}
		if !bytes.Equal(id.servingCA.Raw, msg.GetServingCaDer()) || !pki.MatchPin(pins.ServingCA, id.servingCA.RawSubjectPublicKeyInfo) {
			t.Fatal("accepted a serving CA that is not the pinned one")
		}
		if !bytes.Equal(id.cert.Raw, msg.GetCertificateDer()) || !samePublicKey(id.cert, key.Public()) {
			t.Fatal("accepted a certificate that is not for the machine's key")
		}
		if (ca != nil) != (len(msg.GetNodeCaDer()) > 0) {
			t.Fatalf("node CA %v from a response with %d bytes of it", ca != nil, len(msg.GetNodeCaDer()))
		}
		if ca != nil {
			if !bytes.Equal(ca.Raw, msg.GetNodeCaDer()) {
				t.Fatal("the node CA is not the response's")
			}
			if err := id.cert.CheckSignatureFrom(ca); err != nil {
				t.Fatalf("accepted a certificate the node CA did not sign: %v", err)
			}
		}
		root := msg.GetTrust().GetCommandSigningRoot()
		if !bytes.Equal(id.CommandSigningRoot, root) || (len(root) > 0) != (id.commandRoot != nil) {
			t.Fatal("the command-signing root is not the response's")
		}
		if len(root) > 0 && !pki.MatchPin(pins.CommandSigning, root) {
			t.Fatal("accepted a command-signing root that does not match its pin")
		}
	})
}

func containsMessage(ms []*joinv1.JoinResponse, m *joinv1.JoinResponse) bool {
	return slices.ContainsFunc(ms, func(x *joinv1.JoinResponse) bool { return proto.Equal(x, m) })
}
