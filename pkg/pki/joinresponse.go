package pki

import (
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
)

// ErrUntrustedJoinResponse is matched (errors.Is) by every refusal of a
// JoinResponse by VerifyJoinResponse and CheckJoinResponse: unsigned, signed
// by a key that is not the pinned one, badly signed, or carrying a CA or root
// that does not match its pin. Nothing in a refused response may be used.
var ErrUntrustedJoinResponse = errors.New("join response is not trusted")

func untrusted(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUntrustedJoinResponse, fmt.Sprintf(format, args...))
}

// joinResponseSigningBytes returns the deterministic protobuf encoding of
// resp with its signature empty: what the signature covers (after the
// domain, see SignJoinResponseBytes). resp is not modified.
func joinResponseSigningBytes(resp *joinv1.JoinResponse) ([]byte, error) {
	unsigned := proto.CloneOf(resp)
	unsigned.Signature = nil
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(unsigned)
	if err != nil {
		return nil, fmt.Errorf("encode join response: %w", err)
	}
	return b, nil
}

// SignJoinResponse sets resp.Signature to JoinService's Ed25519 signature
// (RFC 8032) over the JoinResponse domain followed by the deterministic
// protobuf encoding of resp with signature empty (see
// bc.join.v1.JoinResponse.signature). Any previous signature is replaced.
func SignJoinResponse(key ed25519.PrivateKey, resp *joinv1.JoinResponse) error {
	if len(key) != ed25519.PrivateKeySize {
		return errors.New("join signing key is not an Ed25519 private key")
	}
	if resp == nil {
		return errors.New("no join response to sign")
	}
	b, err := joinResponseSigningBytes(resp)
	if err != nil {
		return err
	}
	resp.Signature = SignJoinResponseBytes(key, b)
	return nil
}

// VerifyJoinResponse checks resp's signature with the join signing key
// signingSPKI (a DER SubjectPublicKeyInfo, e.g. from the well-known
// document), after checking that the key is the one pinned by
// joinSigningPin. Errors match ErrUntrustedJoinResponse and say which check
// failed.
func VerifyJoinResponse(resp *joinv1.JoinResponse, joinSigningPin string, signingSPKI []byte) error {
	if joinSigningPin == "" {
		return untrusted("no join signing pin to check it against")
	}
	if !MatchPin(joinSigningPin, signingSPKI) {
		return untrusted("the join signing key (%s) is not the pinned one (%s)", PinOfSPKI(signingSPKI), joinSigningPin)
	}
	pub, err := ParseEd25519SPKI(signingSPKI)
	if err != nil {
		return untrusted("join signing key: %v", err)
	}
	if len(resp.GetSignature()) == 0 {
		return untrusted("it is not signed")
	}
	b, err := joinResponseSigningBytes(resp)
	if err != nil {
		return untrusted("%v", err)
	}
	if !VerifyJoinResponseBytes(pub, b, resp.GetSignature()) {
		return untrusted("its signature does not verify with the pinned join signing key")
	}
	return nil
}

// VerifiedJoin is what a daemon may use of a JoinResponse that
// CheckJoinResponse accepted.
type VerifiedJoin struct {
	// Certificate is the node certificate, signed by NodeCA when the
	// response carries one.
	Certificate *x509.Certificate
	// NodeCA is the node CA certificate, nil when the response has none.
	NodeCA *x509.Certificate
	// ServingCA is the CA of gateway serving certificates; it matches the
	// servingCa pin.
	ServingCA *x509.Certificate
	// CommandSigningRoot is the command-signing root (signedIntent), nil when
	// the deployment does not sign intent.
	CommandSigningRoot ed25519.PublicKey
}

// CheckJoinResponse is the daemon's check of a JoinResponse before it trusts
// anything in it. In order: the signature verifies with signingSPKI, which
// must match pins.JoinSigning (VerifyJoinResponse); the serving CA parses and
// matches pins.ServingCA (required); the node CA, when present, parses and
// signed the node certificate; the command-signing root, when present, is an
// Ed25519 key and matches pins.CommandSigning when that pin is given (without
// the pin the root is trusted because the pinned join signing key signed it).
// Errors match ErrUntrustedJoinResponse.
func CheckJoinResponse(resp *joinv1.JoinResponse, pins Pins, signingSPKI []byte) (*VerifiedJoin, error) {
	if err := VerifyJoinResponse(resp, pins.JoinSigning, signingSPKI); err != nil {
		return nil, err
	}
	var v VerifiedJoin
	var err error
	if pins.ServingCA == "" {
		return nil, untrusted("no serving CA pin to check serving_ca_der against")
	}
	if v.ServingCA, err = x509.ParseCertificate(resp.GetServingCaDer()); err != nil {
		return nil, untrusted("serving_ca_der: %v", err)
	}
	if !MatchPin(pins.ServingCA, v.ServingCA.RawSubjectPublicKeyInfo) {
		return nil, untrusted("serving_ca_der (%s) does not match the serving CA pin (%s)",
			PinOfSPKI(v.ServingCA.RawSubjectPublicKeyInfo), pins.ServingCA)
	}
	if v.Certificate, err = x509.ParseCertificate(resp.GetCertificateDer()); err != nil {
		return nil, untrusted("certificate_der: %v", err)
	}
	if len(resp.GetNodeCaDer()) > 0 {
		if v.NodeCA, err = x509.ParseCertificate(resp.GetNodeCaDer()); err != nil {
			return nil, untrusted("node_ca_der: %v", err)
		}
		if err := v.Certificate.CheckSignatureFrom(v.NodeCA); err != nil {
			return nil, untrusted("certificate_der is not signed by node_ca_der: %v", err)
		}
	}
	if root := resp.GetTrust().GetCommandSigningRoot(); len(root) > 0 {
		if v.CommandSigningRoot, err = ParseEd25519SPKI(root); err != nil {
			return nil, untrusted("trust.command_signing_root: %v", err)
		}
		if pins.CommandSigning != "" && !MatchPin(pins.CommandSigning, root) {
			return nil, untrusted("trust.command_signing_root (%s) does not match the command-signing pin (%s)",
				PinOfSPKI(root), pins.CommandSigning)
		}
	}
	return &v, nil
}
