package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
)

// renewalContext starts what a renewal's proof signs, so that the
// signature can be taken for nothing else.
const renewalContext = "better-compute renewal v1\x00"

// RenewalDigest is what the proof of a certificate renewal signs: SHA-256 of
// "better-compute renewal v1\x00", SHA-256(csrDER) and serial, the
// lower-case hex serial (SerialHex) of the certificate whose key signs
// (gateway.proto, RenewCertificate.proof). The CSR's hash has a fixed length,
// so the two cannot be shifted into one another.
func RenewalDigest(csrDER []byte, serial string) []byte {
	csrSum := sha256.Sum256(csrDER)
	h := sha256.New()
	h.Write([]byte(renewalContext))
	h.Write(csrSum[:])
	h.Write([]byte(serial))
	return h.Sum(nil)
}

// SignRenewal returns the proof that the holder of key, the key of node
// certificate cert, asks for a certificate for csrDER: key's signature of
// RenewalDigest(csrDER, SerialHex(cert)), ASN.1 ECDSA or PKCS #1 v1.5 over
// the digest with SHA-256, or Ed25519 (RFC 8032) of the digest itself.
func SignRenewal(key crypto.Signer, cert *x509.Certificate, csrDER []byte) ([]byte, error) {
	digest := RenewalDigest(csrDER, SerialHex(cert))
	switch key.(type) {
	case ed25519.PrivateKey:
		return key.Sign(rand.Reader, digest, crypto.Hash(0))
	case *ecdsa.PrivateKey, *rsa.PrivateKey:
		sum := sha256.Sum256(digest)
		return key.Sign(rand.Reader, sum[:], crypto.SHA256)
	}
	return nil, fmt.Errorf("sign renewal: unsupported key type %T", key)
}

// ErrRenewalProof is VerifyRenewal's error for a proof that is missing or
// does not verify.
var ErrRenewalProof = errors.New("the renewal's proof does not verify with the session certificate's key")

// VerifyRenewal checks that proof is SignRenewal's by the key of cert for
// csrDER; it returns ErrRenewalProof otherwise.
func VerifyRenewal(cert *x509.Certificate, csrDER, proof []byte) error {
	if len(proof) == 0 {
		return ErrRenewalProof
	}
	digest := RenewalDigest(csrDER, SerialHex(cert))
	var alg x509.SignatureAlgorithm
	switch cert.PublicKey.(type) {
	case ed25519.PublicKey:
		alg = x509.PureEd25519
	case *ecdsa.PublicKey:
		alg = x509.ECDSAWithSHA256
	case *rsa.PublicKey:
		alg = x509.SHA256WithRSA
	default:
		return ErrRenewalProof
	}
	if err := cert.CheckSignature(alg, digest, proof); err != nil {
		return ErrRenewalProof
	}
	return nil
}
