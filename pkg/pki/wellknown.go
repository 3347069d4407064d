package pki

import (
	"bytes"
	"crypto/ecdh"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// WellKnownPath is where the API serves a deployment's WellKnown document
// (unauthenticated, GET only).
const WellKnownPath = "/.well-known/better-compute"

// WellKnown is the JSON document at WellKnownPath: where a daemon joins and
// opens its session, the deployment's pins, and the public keys a daemon
// needs to join. Nothing in it is trusted by itself: a daemon checks each
// key against the pins it was given (JoinKeys) and then the signed
// JoinResponse against the join signing key (CheckJoinResponse).
type WellKnown struct {
	// BaseURL is the public API's base URL (Connect services under
	// /api/compute).
	BaseURL string `json:"baseUrl"`
	// JoinURL is JoinService's base URL.
	JoinURL string `json:"joinUrl"`
	// Gateway is where joined nodes open their Session.
	Gateway WellKnownGateway `json:"gateway"`
	// Pins are the deployment's SPKI pins (see Pins). A daemon must get its
	// pins out of band; these are for display and for trust on first use.
	Pins Pins `json:"pins"`
	// JoinEncryptionKey is JoinService's HPKE (X25519) public key as a DER
	// SubjectPublicKeyInfo (standard base64 in JSON); tokens are sealed to it.
	JoinEncryptionKey []byte `json:"joinEncryptionKey"`
	// JoinSigningKey is the Ed25519 key that signs JoinResponses as a DER
	// SubjectPublicKeyInfo (standard base64 in JSON).
	JoinSigningKey []byte `json:"joinSigningKey"`
	// CommandSigningKey is the command-signing root (Ed25519) as a DER
	// SubjectPublicKeyInfo (standard base64 in JSON), so that a daemon given
	// a command-signing pin checks it before it spends a join token (the
	// JoinResponse's trust.command_signing_root is checked again after).
	// Empty in documents of deployments older than this field.
	CommandSigningKey []byte `json:"commandSigningKey,omitempty"`
	// ServingCA is the CA of gateway serving certificates (PEM).
	ServingCA string `json:"servingCa"`
}

// MaxWellKnownBytes is the largest WellKnown document ParseWellKnown
// decodes, in bytes; a daemon reads at most this much of the answer.
const MaxWellKnownBytes = 1 << 20

// ParseWellKnown decodes a WellKnown document (JSON) as a daemon reads it
// from WellKnownPath. Nothing in it is checked: JoinKeys checks its keys
// against the daemon's pins. Errors: a document larger than
// MaxWellKnownBytes, or JSON that is not a WellKnown object.
func ParseWellKnown(b []byte) (*WellKnown, error) {
	if len(b) > MaxWellKnownBytes {
		return nil, fmt.Errorf("the well-known document is larger than %d bytes", MaxWellKnownBytes)
	}
	var doc WellKnown
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("the well-known document is not a JSON WellKnown object: %w", err)
	}
	return &doc, nil
}

// WellKnownGateway is the gateway part of a WellKnown document.
type WellKnownGateway struct {
	// URLs are the https:// Session URLs of every gateway replica (at least
	// one when the deployment has a gateway); a daemon moves to the next
	// when it loses its session.
	URLs []string `json:"urls"`
	// ServerName is the TLS server name to verify on the gateway.
	ServerName string `json:"serverName"`
}

// NewWellKnown fills a WellKnown document's keys and pins from the public
// files of the PKI directory dir (join-encryption.pub, join-signing.pub,
// serving-ca.crt and command-signing.pub); the caller sets the URLs. Errors
// name the file that is missing or broken. No private key is read.
func NewWellKnown(dir string) (WellKnown, error) {
	pins, err := ComputePins(dir)
	if err != nil {
		return WellKnown{}, err
	}
	enc, sig, err := ReadJoinPublicKeys(dir)
	if err != nil {
		return WellKnown{}, err
	}
	sca, err := LoadCert(filepath.Join(dir, ServingCACert))
	if err != nil {
		return WellKnown{}, fmt.Errorf("%s: %w", ServingCACert, err)
	}
	_, cmd, err := LoadPublicKey(filepath.Join(dir, CommandSigningPub))
	if err != nil {
		return WellKnown{}, err
	}
	if _, err := ParseEd25519SPKI(cmd); err != nil {
		return WellKnown{}, fmt.Errorf("%s: %w", CommandSigningPub, err)
	}
	return WellKnown{Pins: pins, JoinEncryptionKey: enc, JoinSigningKey: sig, CommandSigningKey: cmd,
		ServingCA: string(EncodeCertPEM(sca))}, nil
}

// ReadJoinPublicKeys reads the DER SubjectPublicKeyInfos of JoinService's
// encryption and signing keys from the public files of the PKI directory dir
// (JoinEncryptionPub, JoinSigningPub).
func ReadJoinPublicKeys(dir string) (encryptionSPKI, signingSPKI []byte, err error) {
	if _, encryptionSPKI, err = LoadPublicKey(filepath.Join(dir, JoinEncryptionPub)); err != nil {
		return nil, nil, err
	}
	if _, signingSPKI, err = LoadPublicKey(filepath.Join(dir, JoinSigningPub)); err != nil {
		return nil, nil, err
	}
	return encryptionSPKI, signingSPKI, nil
}

// JoinKeys are the public keys a daemon joins with, checked against its
// pins by CheckJoinKeys.
type JoinKeys struct {
	// Encryption is JoinService's HPKE key: tokens are sealed to it
	// (SealJoinToken).
	Encryption *ecdh.PublicKey
	// SigningSPKI is the DER SubjectPublicKeyInfo of the join signing key,
	// for CheckJoinResponse.
	SigningSPKI []byte
}

// CheckJoinKeys checks JoinService's public keys (DER SubjectPublicKeyInfos)
// against pins.JoinEncryption and pins.JoinSigning, both required, and
// returns them parsed. Errors name the key and both pins.
func CheckJoinKeys(pins Pins, encryptionSPKI, signingSPKI []byte) (JoinKeys, error) {
	if pins.JoinEncryption == "" || pins.JoinSigning == "" {
		return JoinKeys{}, errors.New("the join encryption and join signing pins are required")
	}
	if !MatchPin(pins.JoinEncryption, encryptionSPKI) {
		return JoinKeys{}, fmt.Errorf("the join encryption key (%s) does not match the join encryption pin (%s)",
			PinOfSPKI(encryptionSPKI), pins.JoinEncryption)
	}
	if !MatchPin(pins.JoinSigning, signingSPKI) {
		return JoinKeys{}, fmt.Errorf("the join signing key (%s) does not match the join signing pin (%s)",
			PinOfSPKI(signingSPKI), pins.JoinSigning)
	}
	enc, err := ParseJoinEncryptionSPKI(encryptionSPKI)
	if err != nil {
		return JoinKeys{}, err
	}
	if _, err := ParseEd25519SPKI(signingSPKI); err != nil {
		return JoinKeys{}, fmt.Errorf("join signing key: %w", err)
	}
	return JoinKeys{Encryption: enc, SigningSPKI: signingSPKI}, nil
}

// CheckCommandSigningKey checks the command-signing root (a DER
// SubjectPublicKeyInfo) against pins.CommandSigning, when that pin is given:
// the key must be present, match the pin and be an Ed25519 key. Errors name
// the key and both pins.
func CheckCommandSigningKey(pins Pins, spki []byte) error {
	if pins.CommandSigning == "" {
		return nil
	}
	if len(spki) == 0 {
		return fmt.Errorf("no command-signing key to check the command signing pin (%s) against", pins.CommandSigning)
	}
	if !MatchPin(pins.CommandSigning, spki) {
		return fmt.Errorf("the command-signing key (%s) does not match the command signing pin (%s)",
			PinOfSPKI(spki), pins.CommandSigning)
	}
	if _, err := ParseEd25519SPKI(spki); err != nil {
		return fmt.Errorf("command-signing key: %w", err)
	}
	return nil
}

// JoinKeys checks the document's keys against pins (CheckJoinKeys; its
// serving CA against pins.ServingCA when both are given; its
// commandSigningKey against pins.CommandSigning when that pin is given, a
// document without the key failing) and returns the keys to join with. A
// daemon calls it before Join, so a wrong pin never spends a join token.
// Errors name the field of the document.
func (w *WellKnown) JoinKeys(pins Pins) (JoinKeys, error) {
	if w.ServingCA != "" && pins.ServingCA != "" {
		sca, err := ParseCertPEM([]byte(w.ServingCA))
		if err != nil {
			return JoinKeys{}, fmt.Errorf("well-known document: servingCa: %w", err)
		}
		if !MatchPin(pins.ServingCA, sca.RawSubjectPublicKeyInfo) {
			return JoinKeys{}, fmt.Errorf("well-known document: servingCa (%s) does not match the serving CA pin (%s)",
				PinOfSPKI(sca.RawSubjectPublicKeyInfo), pins.ServingCA)
		}
	}
	k, err := CheckJoinKeys(pins, w.JoinEncryptionKey, w.JoinSigningKey)
	if err != nil {
		return JoinKeys{}, fmt.Errorf("well-known document: %w", err)
	}
	if err := CheckCommandSigningKey(pins, w.CommandSigningKey); err != nil {
		return JoinKeys{}, fmt.Errorf("well-known document: commandSigningKey: %w", err)
	}
	return k, nil
}

// Validate checks the form of every pin that is set (ParsePin); errors name
// the JSON field.
func (p Pins) Validate() error {
	for _, f := range []struct{ name, pin string }{
		{"servingCa", p.ServingCA}, {"joinSigning", p.JoinSigning},
		{"joinEncryption", p.JoinEncryption}, {"commandSigning", p.CommandSigning},
	} {
		if f.pin == "" {
			continue
		}
		if _, err := ParsePin(f.pin); err != nil {
			return fmt.Errorf("%s: %w", f.name, err)
		}
	}
	return nil
}

// ReadPinsFile reads Pins from a pins.json file (as `pki init` writes it)
// and checks their form.
func ReadPinsFile(path string) (Pins, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Pins{}, err
	}
	var p Pins
	if err := json.Unmarshal(b, &p); err != nil {
		return Pins{}, fmt.Errorf("%s: %w", path, err)
	}
	if err := p.Validate(); err != nil {
		return Pins{}, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

// WritePinsFile writes pins as pins.json does (indented JSON, mode 0644)
// to path, atomically, unless path already holds exactly that; it reports
// whether it wrote.
func WritePinsFile(path string, pins Pins) (bool, error) {
	b, err := json.MarshalIndent(pins, "", "  ")
	if err != nil {
		return false, err
	}
	b = append(b, '\n')
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, b) {
		return false, nil
	}
	if err := writeFileAtomic(path, b, 0o644); err != nil {
		return false, err
	}
	return true, nil
}

// SplitGatewayURLs splits a configured gateway URL list — one URL or several
// separated by commas, as in BETTER_COMPUTE_GATEWAY_URL="https://gw-a:8443,https://gw-b:8443"
// — into its URLs, trimmed, empty parts dropped, order kept. It returns nil
// for an empty list.
func SplitGatewayURLs(list string) []string {
	var urls []string
	for _, u := range strings.Split(list, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	return urls
}

// CheckGatewayURL checks one gateway Session URL: it must parse, use https
// (the Session is mutual TLS), name a host, give a port from 1 to 65535 if
// it gives one, and have no query or fragment (the daemon appends the
// Session procedure to it: a path, as behind a proxy, is kept), as in
// "https://gateway:8443". The error quotes raw and says what is wrong with
// it.
func CheckGatewayURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("gateway URL %q does not parse: want https://HOST[:PORT]", raw)
	}
	if u.Scheme != "https" || u.Opaque != "" {
		return fmt.Errorf("gateway URL %q must be https://HOST[:PORT] (the session uses mutual TLS)", raw)
	}
	if u.RawQuery != "" || u.ForceQuery || strings.Contains(raw, "#") {
		return fmt.Errorf("gateway URL %q has a query or fragment: want https://HOST[:PORT]", raw)
	}
	if u.Hostname() == "" {
		return fmt.Errorf("gateway URL %q has no host: want https://HOST[:PORT]", raw)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("gateway URL %q has a bad port %q: want 1 to 65535", raw, p)
		}
	}
	return nil
}

// ParseGatewayURLs splits a configured gateway URL list as SplitGatewayURLs
// does and checks each URL with CheckGatewayURL; it fails on the first bad
// one, and for a list of commas without a URL. An empty list (or one of
// spaces) gives nil, nil.
func ParseGatewayURLs(list string) ([]string, error) {
	urls := SplitGatewayURLs(list)
	if len(urls) == 0 && strings.TrimSpace(list) != "" {
		return nil, fmt.Errorf("gateway URL list %q has no URL: want https://HOST[:PORT][,https://HOST[:PORT]…]", list)
	}
	for _, u := range urls {
		if err := CheckGatewayURL(u); err != nil {
			return nil, err
		}
	}
	return urls, nil
}

// NewWellKnownGateway returns the gateway part of a WellKnown document for a
// configured gateway URL list (see SplitGatewayURLs) and TLS server name.
func NewWellKnownGateway(list, serverName string) WellKnownGateway {
	return WellKnownGateway{URLs: SplitGatewayURLs(list), ServerName: serverName}
}
