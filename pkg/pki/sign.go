package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"io"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"
)

// createCertificate returns the DER of x509.CreateCertificate(rand.Reader,
// tmpl, parent, pub, key), the same bytes but for its signature's
// randomness, without the check that CreateCertificate makes of the
// signature it has just made (a verification, twice a signature's cost:
// a third of JoinService's work per join). That check guards against a
// crypto.Signer that misbehaves (a hardware module, a remote signer); an
// in-memory ECDSA key is Go's own, so for one it signs the certificate as
// CreateCertificate does: the TBSCertificate is CreateCertificate's own,
// handed to a signer that keeps it and signs nothing; it is signed with key
// as signTBS signs it (crypto.SignMessage with the hash of the signature
// algorithm the TBSCertificate names), and wrapped as CreateCertificate
// wraps it: SEQUENCE { TBSCertificate, the same AlgorithmIdentifier, BIT
// STRING signature } (RFC 5280, 4.1). Every other key goes through
// CreateCertificate. TestCreateCertificateAsGo checks the bytes against
// CreateCertificate's and the signature with ParseCertificate and
// CheckSignatureFrom; the gateways verify every certificate at each
// handshake.
func createCertificate(tmpl, parent *x509.Certificate, pub any, key crypto.Signer) ([]byte, error) {
	priv, ok := key.(*ecdsa.PrivateKey)
	if !ok {
		return x509.CreateCertificate(rand.Reader, tmpl, parent, pub, key)
	}
	capture := &tbsCapture{pub: priv.Public()}
	if _, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, capture); capture.tbs == nil {
		if err != nil && !errors.Is(err, errTBSCaptured) {
			return nil, err
		}
		// Not handed the TBSCertificate: CreateCertificate signs it.
		return x509.CreateCertificate(rand.Reader, tmpl, parent, pub, key)
	}
	alg, hash, ok := tbsSignatureAlgorithm(capture.tbs)
	if !ok {
		return x509.CreateCertificate(rand.Reader, tmpl, parent, pub, key)
	}
	sig, err := crypto.SignMessage(priv, rand.Reader, capture.tbs, hash)
	if err != nil {
		return nil, err
	}
	return wrapCertificate(capture.tbs, alg, sig)
}

// signedCertificate is a Certificate (RFC 5280, 4.1) of an encoded
// TBSCertificate and AlgorithmIdentifier.
type signedCertificate struct {
	TBSCertificate     asn1.RawValue
	SignatureAlgorithm asn1.RawValue
	SignatureValue     asn1.BitString
}

// wrapCertificate returns the DER Certificate of tbs (an encoded
// TBSCertificate), alg (the encoded AlgorithmIdentifier that tbs names) and
// sig, as x509.CreateCertificate encodes it.
func wrapCertificate(tbs, alg, sig []byte) ([]byte, error) {
	return asn1.Marshal(signedCertificate{
		TBSCertificate:     asn1.RawValue{FullBytes: tbs},
		SignatureAlgorithm: asn1.RawValue{FullBytes: alg},
		SignatureValue:     asn1.BitString{Bytes: sig, BitLength: len(sig) * 8},
	})
}

// ECDSA signature algorithms (RFC 5758, 3.2) and the hash each signs.
var ecdsaHashes = []struct {
	oid  asn1.ObjectIdentifier
	hash crypto.Hash
}{
	{asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 2}, crypto.SHA256},
	{asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 3}, crypto.SHA384},
	{asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 4}, crypto.SHA512},
}

// tbsSignatureAlgorithm returns the encoded AlgorithmIdentifier of the
// signature field of tbs, an encoded TBSCertificate (RFC 5280, 4.1), and the
// hash that algorithm signs; ok is false when tbs is not one or names no
// ECDSA algorithm with no parameters.
func tbsSignatureAlgorithm(tbs []byte) (alg []byte, hash crypto.Hash, ok bool) {
	in := cryptobyte.String(tbs)
	var seq cryptobyte.String
	if !in.ReadASN1(&seq, cbasn1.SEQUENCE) || !in.Empty() {
		return nil, 0, false
	}
	// version [0] EXPLICIT, optional; serialNumber INTEGER; signature.
	if !seq.SkipOptionalASN1(cbasn1.Tag(0).Constructed().ContextSpecific()) || !seq.SkipASN1(cbasn1.INTEGER) {
		return nil, 0, false
	}
	var full, elem, body cryptobyte.String
	var tag cbasn1.Tag
	if !seq.ReadAnyASN1Element(&full, &tag) || tag != cbasn1.SEQUENCE {
		return nil, 0, false
	}
	elem = full
	var oid asn1.ObjectIdentifier
	if !elem.ReadASN1(&body, cbasn1.SEQUENCE) || !body.ReadASN1ObjectIdentifier(&oid) || !body.Empty() {
		return nil, 0, false
	}
	for _, e := range ecdsaHashes {
		if oid.Equal(e.oid) {
			return bytes.Clone(full), e.hash, true
		}
	}
	return nil, 0, false
}

// errTBSCaptured is what tbsCapture answers instead of a signature.
var errTBSCaptured = errors.New("pki: the certificate to sign was kept, not signed")

// tbsCapture is a crypto.MessageSigner that keeps the message it is asked
// to sign (x509.CreateCertificate's TBSCertificate) and signs nothing.
type tbsCapture struct {
	pub crypto.PublicKey
	tbs []byte
}

// Public returns the key whose signature the caller expects.
func (c *tbsCapture) Public() crypto.PublicKey { return c.pub }

// Sign refuses: a caller that hashes first hands over no TBSCertificate.
func (c *tbsCapture) Sign(io.Reader, []byte, crypto.SignerOpts) ([]byte, error) {
	return nil, errTBSCaptured
}

// SignMessage keeps msg and refuses.
func (c *tbsCapture) SignMessage(_ io.Reader, msg []byte, _ crypto.SignerOpts) ([]byte, error) {
	c.tbs = bytes.Clone(msg)
	return nil, errTBSCaptured
}
