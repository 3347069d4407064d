package pki_test

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/better-compute/better-compute/pkg/pki"
)

// FuzzParseCSR feeds arbitrary bytes to ParseCSR, the check of every CSR a
// machine sends (JoinRequest.csr_der, RenewCertificate.csr_der): it must
// never panic nor return both a request and an error, and what it accepts is
// exactly one DER request (no trailing bytes) with a key of the accepted
// kinds, signed by that key, that the node CA can sign a certificate for.
func FuzzParseCSR(f *testing.F) {
	ca, err := pki.NewCA("fuzz node CA", now.Add(-time.Hour), 24*time.Hour)
	if err != nil {
		f.Fatal(err)
	}
	p256, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	p384, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	p224, err := ecdsa.GenerateKey(elliptic.P224(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	rsa2048, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		f.Fatal(err)
	}
	for _, key := range []any{p256, p384, p224, ed, rsa2048} {
		der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(der)
		f.Add(append(append([]byte(nil), der...), 0))
		tampered := append([]byte(nil), der...)
		tampered[len(tampered)-3] ^= 0x40
		f.Add(tampered)
	}
	f.Add([]byte{})
	f.Add([]byte{0x30, 0x84, 0xff, 0xff, 0xff, 0xff})

	f.Fuzz(func(t *testing.T, der []byte) {
		csr, err := pki.ParseCSR(der)
		if err != nil {
			if csr != nil {
				t.Fatalf("a CSR and an error: %v", err)
			}
			return
		}
		if csr == nil {
			t.Fatal("neither a CSR nor an error")
		}
		if !bytes.Equal(csr.Raw, der) {
			t.Fatalf("accepted %d bytes as a CSR of %d", len(der), len(csr.Raw))
		}
		switch k := csr.PublicKey.(type) {
		case *ecdsa.PublicKey:
			if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
				t.Fatalf("accepted an ECDSA key on %s", k.Curve.Params().Name)
			}
		case ed25519.PublicKey:
		case *rsa.PublicKey:
			if n := k.N.BitLen(); n < pki.MinRSABits || n > pki.MaxRSABits {
				t.Fatalf("accepted an RSA key of %d bits", n)
			}
		default:
			t.Fatalf("accepted a key of type %T", k)
		}
		if err := csr.CheckSignature(); err != nil {
			t.Fatalf("accepted a CSR whose signature does not verify: %v", err)
		}
		cert, err := ca.IssueNode(csr, "node_fuzz", "fuzz.test", now, time.Hour)
		if err != nil {
			t.Fatalf("the node CA cannot sign an accepted CSR: %v", err)
		}
		if !bytes.Equal(cert.RawSubjectPublicKeyInfo, csr.RawSubjectPublicKeyInfo) {
			t.Fatal("the certificate is not for the CSR's key")
		}
	})
}

// canonicalPin reports whether pin is PinPrefix followed by the padded
// standard base64 of 32 bytes, in the one spelling PinOfSPKI writes.
func canonicalPin(pin string) bool {
	rest, ok := strings.CutPrefix(pin, pki.PinPrefix)
	if !ok {
		return false
	}
	sum, err := base64.StdEncoding.Strict().DecodeString(rest)
	return err == nil && len(sum) == sha256.Size && base64.StdEncoding.EncodeToString(sum) == rest
}

// FuzzPins feeds an arbitrary pin to ParsePin and MatchPin, and arbitrary
// bytes as a pins.json to the checks of ReadPinsFile (json.Unmarshal, then
// Pins.Validate). ParsePin accepts exactly the canonical pins and returns
// their digest (the pin round-trips through it); MatchPin matches exactly
// the key whose PinOfSPKI is the pin; Validate accepts a pins file only
// when every pin in it is canonical, and its errors name the field.
func FuzzPins(f *testing.F) {
	spki, err := x509.MarshalPKIXPublicKey(ed25519.PublicKey(make([]byte, ed25519.PublicKeySize)))
	if err != nil {
		f.Fatal(err)
	}
	good := pki.PinOfSPKI(spki)
	pins, err := json.Marshal(pki.Pins{ServingCA: good, JoinSigning: good, JoinEncryption: good, CommandSigning: good})
	if err != nil {
		f.Fatal(err)
	}
	for _, pin := range []string{good, "", pki.PinPrefix, "sha256/", good[:len(good)-1], good + "=", strings.TrimSuffix(good, "=") + "A",
		"SHA256/" + good[len(pki.PinPrefix):], "sha512/" + good[len(pki.PinPrefix):], good[:20] + "\n" + good[20:], " " + good,
		pki.PinPrefix + base64.RawStdEncoding.EncodeToString(make([]byte, 32)), pki.PinPrefix + base64.URLEncoding.EncodeToString(make([]byte, 32))} {
		f.Add(pin, spki, pins)
	}
	f.Add(good, []byte{}, []byte(`{"servingCa": "sha256/x"}`))
	f.Add(good, spki, []byte(`{"servingCa": null, "joinSigning": 7}`))

	f.Fuzz(func(t *testing.T, pin string, spki, pinsJSON []byte) {
		sum, err := pki.ParsePin(pin)
		switch {
		case err != nil && sum != nil:
			t.Fatalf("a digest and an error for %q: %v", pin, err)
		case err == nil && !canonicalPin(pin):
			t.Fatalf("accepted %q, which is not a canonical pin", pin)
		case err != nil && canonicalPin(pin):
			t.Fatalf("refused the canonical pin %q: %v", pin, err)
		case err == nil && pki.PinPrefix+base64.StdEncoding.EncodeToString(sum) != pin:
			t.Fatalf("pin %q gave digest %x, which is another pin", pin, sum)
		}
		if got, want := pki.MatchPin(pin, spki), pin == pki.PinOfSPKI(spki); got != want {
			t.Fatalf("MatchPin(%q, %x) = %v, want %v", pin, spki, got, want)
		}

		var p pki.Pins
		if json.Unmarshal(pinsJSON, &p) != nil {
			return // ReadPinsFile refuses it as JSON
		}
		err = p.Validate()
		fields := []struct{ name, pin string }{{"servingCa", p.ServingCA}, {"joinSigning", p.JoinSigning},
			{"joinEncryption", p.JoinEncryption}, {"commandSigning", p.CommandSigning}}
		for _, fd := range fields {
			if fd.pin != "" && !canonicalPin(fd.pin) {
				if err == nil || !strings.HasPrefix(err.Error(), fd.name+": ") {
					t.Fatalf("pins %+v: %s %q is not canonical, but Validate said %v", p, fd.name, fd.pin, err)
				}
				return
			}
		}
		if err != nil {
			t.Fatalf("refused pins %+v, all canonical: %v", p, err)
		}
	})
}

// FuzzGatewayURLs feeds an arbitrary configured gateway URL list (the
// BETTER_COMPUTE_GATEWAY_URL of daemons and of the API's well-known
// document) to ParseGatewayURLs and each URL to CheckGatewayURL. An accepted
// list round-trips (its URLs joined with commas parse to themselves); each
// accepted URL is one a daemon can open its session on: https, with a
// host, and the Session procedure's URL built from it (as the Connect
// client builds it) goes to that host at a path ending in the procedure,
// with no query or fragment swallowing it.
func FuzzGatewayURLs(f *testing.F) {
	for _, list := range []string{"https://gw:8443", " https://gw-a:8443 ,https://gw-b.example, https://[::1]:8443/session",
		"", " , ,", "gateway:8443", "http://gw", "https://", "https://:8443", "https://gw:0", "https://gw:99999",
		"https://gw:84 43", "https://gw:8443/", "https://gw:8443?x=1", "https://gw:8443#frag", "https://u:p@gw:8443",
		"https:gw", "https://gw:8443/a%2Fb", "https://[fe80::1%25eth0]:8443", "HTTPS://GW:8443", "https://gw:+80"} {
		f.Add(list)
	}

	f.Fuzz(func(t *testing.T, list string) {
		urls, err := pki.ParseGatewayURLs(list)
		if err != nil {
			if urls != nil {
				t.Fatalf("URLs and an error for %q: %v", list, err)
			}
			return
		}
		if len(urls) == 0 {
			if strings.TrimSpace(list) != "" {
				t.Fatalf("no URL and no error for %q", list)
			}
			return
		}
		again, err := pki.ParseGatewayURLs(strings.Join(urls, ","))
		if err != nil || !reflect.DeepEqual(again, urls) {
			t.Fatalf("list %q gave %q, which parses to %q, %v", list, urls, again, err)
		}
		for _, raw := range urls {
			if err := pki.CheckGatewayURL(raw); err != nil {
				t.Fatalf("ParseGatewayURLs accepted %q, which CheckGatewayURL refuses: %v", raw, err)
			}
			u, err := url.Parse(raw)
			if err != nil || u.Scheme != "https" || u.Hostname() == "" {
				t.Fatalf("accepted %q: %v", raw, err)
			}
			// gatewayv1connect.NewGatewayServiceClient's URL of Session.
			procedure := gatewayv1connect.GatewayServiceSessionProcedure
			target, err := url.ParseRequestURI(strings.TrimRight(raw, "/") + procedure)
			if err != nil {
				t.Fatalf("accepted %q, whose session URL does not parse: %v", raw, err)
			}
			if target.Host != u.Host || target.RawQuery != "" || target.Fragment != "" || !strings.HasSuffix(target.Path, procedure) {
				t.Fatalf("accepted %q, whose session URL is %q (host %q, path %q, query %q, fragment %q)", raw, target,
					target.Host, target.Path, target.RawQuery, target.Fragment)
			}
		}
	})
}

// FuzzWellKnown feeds arbitrary bytes as a well-known document to
// ParseWellKnown, as a daemon reads it, and checks its keys with JoinKeys
// against a deployment's pins (a daemon given its pins) and against the
// document's own pins (trust on first use). A decoded document round-trips
// through JSON; the keys JoinKeys returns for the deployment's pins are the
// deployment's own, and those it returns for any pins are the keys those
// pins name, usable to seal a token.
func FuzzWellKnown(f *testing.F) {
	d := newDeployment(f)
	wk, err := pki.NewWellKnown(d.dir)
	if err != nil {
		f.Fatal(err)
	}
	wk.BaseURL, wk.JoinURL = "https://api.example", "https://join.example"
	wk.Gateway = pki.NewWellKnownGateway("https://gw-a:8443,https://gw-b:8443", "gw.example")
	other := newDeployment(f)
	owk, err := pki.NewWellKnown(other.dir)
	if err != nil {
		f.Fatal(err)
	}
	for _, w := range []pki.WellKnown{wk, owk, {}, {Pins: d.pins}, {JoinEncryptionKey: wk.JoinEncryptionKey, JoinSigningKey: wk.JoinSigningKey}} {
		b, err := json.MarshalIndent(w, "", "  ")
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	mixed := wk
	mixed.ServingCA = owk.ServingCA
	b, err := json.Marshal(mixed)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	for _, s := range []string{"", "null", "[]", `{"joinEncryptionKey": "not base64"}`, `{"gateway": {"urls": "https://gw"}}`, `{} {}`} {
		f.Add([]byte(s))
	}
	encKey, err := pki.ParseJoinEncryptionSPKI(d.encSPKI)
	if err != nil {
		f.Fatal(err)
	}

	f.Fuzz(func(t *testing.T, b []byte) {
		doc, err := pki.ParseWellKnown(b)
		if err != nil {
			if doc != nil {
				t.Fatalf("a document and an error: %v", err)
			}
			return
		}
		again, err := json.Marshal(doc)
		if err != nil {
			t.Fatalf("a decoded document does not encode: %v", err)
		}
		// An empty list or key and an absent one are the same document
		// (the encoding omits both).
		back, err := pki.ParseWellKnown(again)
		if err != nil {
			t.Fatalf("document %s does not decode again: %v", again, err)
		}
		if diff := cmp.Diff(doc, back, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("document %s does not round-trip (-decoded +again):\n%s", again, diff)
		}

		if k, err := doc.JoinKeys(d.pins); err == nil {
			if !bytes.Equal(k.SigningSPKI, d.signSPKI) || !k.Encryption.Equal(encKey) {
				t.Fatal("JoinKeys accepted keys that are not the pinned deployment's")
			}
		}
		k, err := doc.JoinKeys(doc.Pins)
		if err != nil {
			return
		}
		if !pki.MatchPin(doc.Pins.JoinSigning, k.SigningSPKI) || !pki.MatchPin(doc.Pins.JoinEncryption, doc.JoinEncryptionKey) {
			t.Fatal("JoinKeys accepted keys that its pins do not name")
		}
		if _, err := pki.ParseEd25519SPKI(k.SigningSPKI); err != nil {
			t.Fatalf("JoinKeys accepted a signing key that does not parse: %v", err)
		}
		if _, err := pki.SealJoinToken(k.Encryption, "bcjt_fuzz", []byte("csr")); err != nil {
			t.Fatalf("JoinKeys accepted an encryption key that cannot seal: %v", err)
		}
	})
}
