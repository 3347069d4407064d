package pki

import (
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestSealOpenJoinToken(t *testing.T) {
	k, err := GenerateJoinEncryptionKey()
	if err != nil {
		t.Fatal(err)
	}
	other, err := GenerateJoinEncryptionKey()
	if err != nil {
		t.Fatal(err)
	}
	csr, otherCSR := []byte("csr one"), []byte("csr two")
	sealed, err := SealJoinToken(k.PublicKey(), "bcjt_secret", csr)
	if err != nil {
		t.Fatal(err)
	}
	got, err := OpenJoinToken(k, sealed, csr)
	if err != nil || got != "bcjt_secret" {
		t.Fatalf("OpenJoinToken = %q, %v; want bcjt_secret", got, err)
	}
	tampered := append([]byte(nil), sealed...)
	tampered[len(tampered)-1] ^= 1
	for name, tc := range map[string]struct {
		key    interface{}
		sealed []byte
		csr    []byte
	}{
		"other key": {other, sealed, csr},
		"other csr": {k, sealed, otherCSR},
		"tampered":  {k, tampered, csr},
		"short":     {k, sealed[:joinEncLen], csr},
		"empty":     {k, nil, csr},
	} {
		t.Run(name, func(t *testing.T) {
			key := k
			if tc.key == other {
				key = other
			}
			if _, err := OpenJoinToken(key, tc.sealed, tc.csr); !errors.Is(err, ErrSealOpen) {
				t.Fatalf("OpenJoinToken error = %v; want ErrSealOpen", err)
			}
		})
	}
}

func TestInitWritesTrustKeysAndPins(t *testing.T) {
	dir := t.TempDir()
	if _, err := Init(dir, InitOptions{}, testNow); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{JoinEncryptionKey, JoinSigningKey, CommandSigningKey, NodeCAKey, ServingCAKey, GatewayKey} {
		st, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v; want 0600", f, st.Mode().Perm())
		}
	}
	pins, err := ReadPins(dir)
	if err != nil {
		t.Fatal(err)
	}
	sca, err := LoadCert(filepath.Join(dir, ServingCACert))
	if err != nil {
		t.Fatal(err)
	}
	if !MatchPin(pins.ServingCA, sca.RawSubjectPublicKeyInfo) {
		t.Error("servingCa pin does not match the serving CA")
	}
	sk, err := LoadSigningKey(filepath.Join(dir, JoinSigningKey))
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(sk.Public())
	if err != nil {
		t.Fatal(err)
	}
	if !MatchPin(pins.JoinSigning, der) || MatchPin(pins.JoinEncryption, der) {
		t.Error("joinSigning pin does not name the join signing key alone")
	}
	ek, err := LoadJoinEncryptionKey(filepath.Join(dir, JoinEncryptionKey))
	if err != nil {
		t.Fatal(err)
	}
	pin, err := SPKIPin(ek.PublicKey())
	if err != nil {
		t.Fatal(err)
	}
	if pin != pins.JoinEncryption {
		t.Errorf("joinEncryption pin %s; want %s", pins.JoinEncryption, pin)
	}
	// A second Init changes nothing.
	res, err := Init(dir, InitOptions{}, testNow)
	if err != nil || res.Wrote {
		t.Fatalf("second Init wrote=%v err=%v; want nothing written", res.Wrote, err)
	}
}

func TestIntentSignatureBoundToNode(t *testing.T) {
	k, err := GenerateSigningKey()
	if err != nil {
		t.Fatal(err)
	}
	msg := []byte("command bytes")
	sig := SignIntent(k, CommandSigningInput("node_a", msg))
	if !VerifyIntent(k.Public().(ed25519PublicKey), CommandSigningInput("node_a", msg), sig) {
		t.Fatal("signature does not verify")
	}
	if VerifyIntent(k.Public().(ed25519PublicKey), CommandSigningInput("node_b", msg), sig) {
		t.Fatal("signature for node_a verifies for node_b")
	}
	if VerifyIntent(k.Public().(ed25519PublicKey), SpecSigningInput("node_a", msg), sig) {
		t.Fatal("command signature verifies as a spec signature")
	}
}

type ed25519PublicKey = ed25519.PublicKey

var testNow = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
