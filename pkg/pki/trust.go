package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdh"
	"crypto/ed25519"
	"crypto/hpke"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// File names of the trust keys inside a PKI directory (besides the CAs of
// pki.go). Private keys are PKCS#8 PEM, mode 0600; public keys are PKIX
// ("PUBLIC KEY") PEM, mode 0644.
const (
	// JoinEncryptionKey is JoinService's HPKE (X25519) private key, which
	// opens sealed join tokens; JoinEncryptionPub is its public key.
	JoinEncryptionKey = "join-encryption.key"
	JoinEncryptionPub = "join-encryption.pub"
	// JoinSigningKey is JoinService's Ed25519 key, which signs
	// JoinResponses; JoinSigningPub is its public key.
	JoinSigningKey = "join-signing.key"
	JoinSigningPub = "join-signing.pub"
	// CommandSigningKey is the command-signing root (Ed25519), which signs
	// every command and NodeSpec when signedIntent is on;
	// CommandSigningPub is its public key.
	CommandSigningKey = "command-signing.key"
	CommandSigningPub = "command-signing.pub"
	// TunnelTicketKey signs exec tickets (Ed25519): the API issues them and
	// gateways verify them with TunnelTicketPub before they open a tunnel.
	TunnelTicketKey = "tunnel-ticket.key"
	TunnelTicketPub = "tunnel-ticket.pub"
	// SSHBreakGlassCAKey is the break-glass SSH user CA (Ed25519):
	// certificates for principal root on one node, for operators.
	SSHBreakGlassCAKey = "ssh-break-glass-ca.key"
	SSHBreakGlassCAPub = "ssh-break-glass-ca.pub"
	// SSHSandboxCAKey is the sandbox SSH user CA (Ed25519): certificates
	// whose principal is a reservation, for its tenant.
	SSHSandboxCAKey = "ssh-sandbox-ca.key"
	SSHSandboxCAPub = "ssh-sandbox-ca.pub"
	// PinsJSON holds the deployment's Pins (public, mode 0644).
	PinsJSON = "pins.json"
)

// PinPrefix starts every pin: a pin is "sha256/" followed by the standard
// base64 of the SHA-256 of a key's DER SubjectPublicKeyInfo (the form of
// RFC 7469's pin-sha256).
const PinPrefix = "sha256/"

// Pins are the SPKI pins a daemon checks before it trusts a deployment.
type Pins struct {
	// ServingCA pins the CA of gateway serving certificates.
	ServingCA string `json:"servingCa"`
	// JoinSigning pins the key that signs JoinResponses.
	JoinSigning string `json:"joinSigning"`
	// JoinEncryption pins the HPKE key join tokens are sealed to.
	JoinEncryption string `json:"joinEncryption"`
	// CommandSigning pins the command-signing root.
	CommandSigning string `json:"commandSigning,omitempty"`
}

// SPKIPin returns the pin of a public key (see PinPrefix).
func SPKIPin(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", fmt.Errorf("marshal public key: %w", err)
	}
	return PinOfSPKI(der), nil
}

// PinOfSPKI returns the pin of a DER SubjectPublicKeyInfo.
func PinOfSPKI(spkiDER []byte) string {
	sum := sha256.Sum256(spkiDER)
	return PinPrefix + base64.StdEncoding.EncodeToString(sum[:])
}

// ParsePin checks the form of a pin ("sha256/" + the padded standard
// base64 of 32 bytes, spelt as PinOfSPKI spells it: no line breaks, zero
// padding bits) and returns its digest, so that one key has one pin. Errors
// say what is wrong.
func ParsePin(pin string) ([]byte, error) {
	rest, ok := strings.CutPrefix(pin, PinPrefix)
	if !ok {
		return nil, fmt.Errorf("pin %q does not start with %q", pin, PinPrefix)
	}
	sum, err := base64.StdEncoding.DecodeString(rest)
	if err != nil || len(sum) != sha256.Size || base64.StdEncoding.EncodeToString(sum) != rest {
		return nil, fmt.Errorf("pin %q is not base64 of a SHA-256 digest", pin)
	}
	return sum, nil
}

// MatchPin reports whether spkiDER is the key that pin names. A malformed
// pin matches nothing.
func MatchPin(pin string, spkiDER []byte) bool {
	want, err := ParsePin(pin)
	if err != nil {
		return false
	}
	got := sha256.Sum256(spkiDER)
	return subtle.ConstantTimeCompare(want, got[:]) == 1
}

// The HPKE suite of sealed join tokens (RFC 9180 §7):
// DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20-Poly1305, base mode.
// The KEM is implied by the key type (hpke.NewDHKEMPublicKey).
var (
	joinKDF  = hpke.HKDFSHA256()
	joinAEAD = hpke.ChaCha20Poly1305()
)

// joinSealInfo is the HPKE info string of sealed join tokens.
const joinSealInfo = "better-compute join token v1"

// joinEncLen is the length of the X25519 encapsulated key (RFC 9180 §7.1).
const joinEncLen = 32

// ErrSealOpen is matched (errors.Is) by every failure to open a sealed join
// token: sealed to another key, tampered with, or bound to another CSR.
var ErrSealOpen = errors.New("sealed_token cannot be opened: it is not sealed to this deployment's join key or not bound to this CSR")

// CSRBinding returns the associated data that binds a sealed join token to a
// CSR: SHA-256(csrDER).
func CSRBinding(csrDER []byte) []byte {
	sum := sha256.Sum256(csrDER)
	return sum[:]
}

// SealJoinToken seals token to JoinService's HPKE public key pub (an X25519
// key) with CSRBinding(csrDER) as associated data, and returns the
// encapsulated key followed by the ciphertext.
func SealJoinToken(pub *ecdh.PublicKey, token string, csrDER []byte) ([]byte, error) {
	pk, err := hpke.NewDHKEMPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("join encryption key: %w", err)
	}
	enc, sender, err := hpke.NewSender(pk, joinKDF, joinAEAD, []byte(joinSealInfo))
	if err != nil {
		return nil, err
	}
	ct, err := sender.Seal(CSRBinding(csrDER), []byte(token))
	if err != nil {
		return nil, err
	}
	return append(enc, ct...), nil
}

// OpenJoinToken opens a token sealed by SealJoinToken with JoinService's
// private key priv, checking that it was bound to csrDER. Every failure
// matches ErrSealOpen.
func OpenJoinToken(priv *ecdh.PrivateKey, sealed, csrDER []byte) (string, error) {
	if len(sealed) <= joinEncLen {
		return "", ErrSealOpen
	}
	sk, err := hpke.NewDHKEMPrivateKey(priv)
	if err != nil {
		return "", fmt.Errorf("join encryption key: %w", err)
	}
	r, err := hpke.NewRecipient(sealed[:joinEncLen], sk, joinKDF, joinAEAD, []byte(joinSealInfo))
	if err != nil {
		return "", ErrSealOpen
	}
	pt, err := r.Open(CSRBinding(csrDER), sealed[joinEncLen:])
	if err != nil {
		return "", ErrSealOpen
	}
	return string(pt), nil
}

// GenerateJoinEncryptionKey returns a new X25519 key for sealed join tokens.
func GenerateJoinEncryptionKey() (*ecdh.PrivateKey, error) {
	return ecdh.X25519().GenerateKey(rand.Reader)
}

// GenerateSigningKey returns a new Ed25519 key (JoinResponse signing, the
// command-signing root).
func GenerateSigningKey() (ed25519.PrivateKey, error) {
	_, k, err := ed25519.GenerateKey(rand.Reader)
	return k, err
}

// Signing domains: every signed message starts with its domain, so a
// signature over one kind of message is never valid for another.
const (
	domainJoinResponse = "better-compute join response v1\x00"
	domainCommand      = "better-compute command v1\x00"
	domainSpec         = "better-compute node spec v1\x00"
)

// signWithDomain returns key's Ed25519 signature (RFC 8032) over
// domain || msg.
func signWithDomain(key ed25519.PrivateKey, domain string, msg []byte) []byte {
	return ed25519.Sign(key, append([]byte(domain), msg...))
}

func verifyWithDomain(pub ed25519.PublicKey, domain string, msg, sig []byte) bool {
	if len(pub) != ed25519.PublicKeySize || len(sig) != ed25519.SignatureSize {
		return false
	}
	return ed25519.Verify(pub, append([]byte(domain), msg...), sig)
}

// SignJoinResponseBytes signs the deterministic encoding of a JoinResponse
// whose signature field is empty (see bc.join.v1.JoinResponse.signature).
func SignJoinResponseBytes(key ed25519.PrivateKey, unsigned []byte) []byte {
	return signWithDomain(key, domainJoinResponse, unsigned)
}

// VerifyJoinResponseBytes checks a JoinResponse signature made by
// SignJoinResponseBytes.
func VerifyJoinResponseBytes(pub ed25519.PublicKey, unsigned, sig []byte) bool {
	return verifyWithDomain(pub, domainJoinResponse, unsigned, sig)
}

// SignIntent signs a command or spec signing input (CommandSigningInput,
// SpecSigningInput) with the command-signing root.
func SignIntent(key ed25519.PrivateKey, input []byte) []byte { return ed25519.Sign(key, input) }

// VerifyIntent checks a signature made by SignIntent.
func VerifyIntent(pub ed25519.PublicKey, input, sig []byte) bool {
	if len(pub) != ed25519.PublicKeySize || len(sig) != ed25519.SignatureSize {
		return false
	}
	return ed25519.Verify(pub, input, sig)
}

// CommandSigningInput returns the bytes a command's signature covers: the
// command domain, then the node id and the deterministic encoding of the
// bc.gateway.v1.Command with signature empty, each length-prefixed, so that a
// command signed for one node is refused by every other.
func CommandSigningInput(nodeID string, unsignedCommand []byte) []byte {
	return lengthPrefixed(domainCommand, []byte(nodeID), unsignedCommand)
}

// SpecSigningInput returns the bytes a DesiredState's signature covers: the
// spec domain, then the node id and the deterministic encoding of the
// bc.gateway.v1.DesiredState with signature empty (generation and spec),
// each length-prefixed.
func SpecSigningInput(nodeID string, unsignedDesiredState []byte) []byte {
	return lengthPrefixed(domainSpec, []byte(nodeID), unsignedDesiredState)
}

func lengthPrefixed(domain string, parts ...[]byte) []byte {
	var b bytes.Buffer
	b.WriteString(domain)
	for _, p := range parts {
		var n [4]byte
		n[0], n[1], n[2], n[3] = byte(len(p)>>24), byte(len(p)>>16), byte(len(p)>>8), byte(len(p))
		b.Write(n[:])
		b.Write(p)
	}
	return b.Bytes()
}

// EncodePublicKeyPEM returns pub as a PKIX "PUBLIC KEY" PEM block.
func EncodePublicKeyPEM(pub crypto.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), nil
}

// ParsePublicKeyPEM parses a PKIX "PUBLIC KEY" PEM block and returns the
// key and its DER SubjectPublicKeyInfo.
func ParsePublicKeyPEM(b []byte) (crypto.PublicKey, []byte, error) {
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PUBLIC KEY" {
		return nil, nil, errors.New("no PUBLIC KEY PEM block")
	}
	pub, err := x509.ParsePKIXPublicKey(blk.Bytes)
	return pub, blk.Bytes, err
}

// ParseJoinEncryptionSPKI parses the DER SubjectPublicKeyInfo of an X25519
// join encryption key.
func ParseJoinEncryptionSPKI(der []byte) (*ecdh.PublicKey, error) {
	pub, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return nil, fmt.Errorf("join encryption key: %w", err)
	}
	k, ok := pub.(*ecdh.PublicKey)
	if !ok || k.Curve() != ecdh.X25519() {
		return nil, errors.New("join encryption key is not an X25519 key")
	}
	return k, nil
}

// ParseEd25519SPKI parses the DER SubjectPublicKeyInfo of an Ed25519 key.
func ParseEd25519SPKI(der []byte) (ed25519.PublicKey, error) {
	pub, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return nil, err
	}
	k, ok := pub.(ed25519.PublicKey)
	if !ok {
		return nil, errors.New("key is not an Ed25519 key")
	}
	return k, nil
}

// writePrivateKey writes any PKCS#8-encodable key as PEM, owner-only.
func writePrivateKey(path string, key any) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

func writePublicKey(path string, pub crypto.PublicKey) error {
	b, err := EncodePublicKeyPEM(pub)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, b, 0o644)
}

func readPrivateKey(path string) (any, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, fmt.Errorf("%s: no PRIVATE KEY PEM block", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return k, nil
}

// LoadJoinEncryptionKey reads JoinService's HPKE private key (PKCS#8 PEM).
func LoadJoinEncryptionKey(path string) (*ecdh.PrivateKey, error) {
	k, err := readPrivateKey(path)
	if err != nil {
		return nil, err
	}
	ek, ok := k.(*ecdh.PrivateKey)
	if !ok || ek.Curve() != ecdh.X25519() {
		return nil, fmt.Errorf("%s: not an X25519 private key", path)
	}
	return ek, nil
}

// LoadSigningKey reads an Ed25519 private key (PKCS#8 PEM).
func LoadSigningKey(path string) (ed25519.PrivateKey, error) {
	k, err := readPrivateKey(path)
	if err != nil {
		return nil, err
	}
	sk, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("%s: not an Ed25519 private key", path)
	}
	return sk, nil
}

// LoadPublicKey reads a PKIX PEM public key file and returns the key and its
// DER SubjectPublicKeyInfo.
func LoadPublicKey(path string) (crypto.PublicKey, []byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	pub, der, err := ParsePublicKeyPEM(b)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return pub, der, nil
}

// ReadPins reads the pins of a PKI directory (PinsJSON).
func ReadPins(dir string) (Pins, error) {
	b, err := os.ReadFile(filepath.Join(dir, PinsJSON))
	if err != nil {
		return Pins{}, err
	}
	var p Pins
	if err := json.Unmarshal(b, &p); err != nil {
		return Pins{}, fmt.Errorf("%s: %w", PinsJSON, err)
	}
	return p, nil
}

// ComputePins derives the pins of a PKI directory from its public files.
func ComputePins(dir string) (Pins, error) {
	p := func(n string) string { return filepath.Join(dir, n) }
	sca, err := LoadCert(p(ServingCACert))
	if err != nil {
		return Pins{}, err
	}
	var pins Pins
	pins.ServingCA = PinOfSPKI(sca.RawSubjectPublicKeyInfo)
	for _, f := range []struct {
		file string
		dst  *string
	}{{JoinSigningPub, &pins.JoinSigning}, {JoinEncryptionPub, &pins.JoinEncryption}, {CommandSigningPub, &pins.CommandSigning}} {
		_, der, err := LoadPublicKey(p(f.file))
		if err != nil {
			return Pins{}, err
		}
		*f.dst = PinOfSPKI(der)
	}
	return pins, nil
}

// initTrustKeys writes the join encryption key, the join signing key and the
// command-signing root into dir when missing, then pins.json from the public
// files. An existing private key is never replaced: it must parse as its
// kind, its public file must be its key's (a missing one is derived from
// it), and a public file without its key is an error. Errors name the file.
// It reports whether it wrote anything.
func initTrustKeys(dir string) (bool, error) {
	p := func(n string) string { return filepath.Join(dir, n) }
	wrote := false
	for _, f := range []struct {
		key, pub string
		load     func(path string) (crypto.PublicKey, error)
		generate func() (any, crypto.PublicKey, error)
	}{
		{JoinEncryptionKey, JoinEncryptionPub,
			func(path string) (crypto.PublicKey, error) {
				k, err := LoadJoinEncryptionKey(path)
				if err != nil {
					return nil, err
				}
				return k.PublicKey(), nil
			},
			func() (any, crypto.PublicKey, error) {
				k, err := GenerateJoinEncryptionKey()
				if err != nil {
					return nil, nil, err
				}
				return k, k.PublicKey(), nil
			}},
		{JoinSigningKey, JoinSigningPub, loadSigningPublic, generateSigning},
		{CommandSigningKey, CommandSigningPub, loadSigningPublic, generateSigning},
		{TunnelTicketKey, TunnelTicketPub, loadSigningPublic, generateSigning},
		{SSHBreakGlassCAKey, SSHBreakGlassCAPub, loadSigningPublic, generateSigning},
		{SSHSandboxCAKey, SSHSandboxCAPub, loadSigningPublic, generateSigning},
	} {
		keyOK, pubOK := exists(p(f.key)), exists(p(f.pub))
		switch {
		case keyOK:
			pub, err := f.load(p(f.key))
			if err != nil {
				return false, err
			}
			if pubOK {
				have, _, err := LoadPublicKey(p(f.pub))
				if err != nil {
					return false, err
				}
				if !publicKeysEqual(pub, have) {
					return false, fmt.Errorf("%s does not match %s: remove %s to derive it from the key", p(f.pub), p(f.key), p(f.pub))
				}
				continue
			}
			if err := writePublicKey(p(f.pub), pub); err != nil {
				return false, err
			}
			wrote = true
		case pubOK:
			return false, fmt.Errorf("%s is missing but %s exists: restore the key from a backup, or remove both to make a new one "+
				"(which changes its pin)", p(f.key), p(f.pub))
		default:
			k, pub, err := f.generate()
			if err != nil {
				return false, err
			}
			if err := writePrivateKey(p(f.key), k); err != nil {
				return false, err
			}
			if err := writePublicKey(p(f.pub), pub); err != nil {
				return false, err
			}
			wrote = true
		}
	}
	pins, err := ComputePins(dir)
	if err != nil {
		return false, err
	}
	b, err := json.MarshalIndent(pins, "", "  ")
	if err != nil {
		return false, err
	}
	b = append(b, '\n')
	if old, err := os.ReadFile(p(PinsJSON)); err != nil || !bytes.Equal(old, b) {
		if err := writeFileAtomic(p(PinsJSON), b, 0o644); err != nil {
			return false, err
		}
		wrote = true
	}
	return wrote, nil
}

func loadSigningPublic(path string) (crypto.PublicKey, error) {
	k, err := LoadSigningKey(path)
	if err != nil {
		return nil, err
	}
	return k.Public(), nil
}

func generateSigning() (any, crypto.PublicKey, error) {
	k, err := GenerateSigningKey()
	if err != nil {
		return nil, nil, err
	}
	return k, k.Public(), nil
}
