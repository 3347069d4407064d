package pki_test

import (
	"crypto/ed25519"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/pki"
)

// deployment is a PKI directory made by Init, with its keys loaded.
type deployment struct {
	dir         string
	pins        pki.Pins
	signKey     ed25519.PrivateKey
	signSPKI    []byte
	encSPKI     []byte
	nodeCA      *pki.CA
	servingCA   *x509.Certificate
	commandSPKI []byte
}

func newDeployment(t testing.TB) *deployment {
	t.Helper()
	d := &deployment{dir: t.TempDir()}
	_, err := pki.Init(d.dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	p := func(n string) string { return filepath.Join(d.dir, n) }
	d.pins, err = pki.ReadPinsFile(p(pki.PinsJSON))
	require.NoError(t, err)
	d.signKey, err = pki.LoadSigningKey(p(pki.JoinSigningKey))
	require.NoError(t, err)
	d.encSPKI, d.signSPKI, err = pki.ReadJoinPublicKeys(d.dir)
	require.NoError(t, err)
	d.nodeCA, err = pki.LoadCA(p(pki.NodeCACert), p(pki.NodeCAKey))
	require.NoError(t, err)
	d.servingCA, err = pki.LoadCert(p(pki.ServingCACert))
	require.NoError(t, err)
	_, d.commandSPKI, err = pki.LoadPublicKey(p(pki.CommandSigningPub))
	require.NoError(t, err)
	return d
}

// response returns a JoinResponse as JoinService makes it, unsigned.
func (d *deployment) response(t *testing.T) *joinv1.JoinResponse {
	t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	der, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	csr, err := pki.ParseCSR(der)
	require.NoError(t, err)
	cert, err := d.nodeCA.IssueNode(csr, "node_01", pki.DefaultTrustDomain, now, time.Hour)
	require.NoError(t, err)
	return &joinv1.JoinResponse{
		NodeId: "node_01", CertificateDer: cert.Raw, NodeCaDer: d.nodeCA.Cert.Raw,
		GatewayUrls: []string{"https://gw.example:8443"}, GatewayServerName: "gw.example", ServingCaDer: d.servingCA.Raw,
		TrustDomain: pki.DefaultTrustDomain, NotAfter: timestamppb.New(cert.NotAfter), PoolId: "pool_01",
		Trust: &joinv1.Trust{CommandSigningRoot: d.commandSPKI},
	}
}

func TestCheckJoinResponseAcceptsASignedResponse(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	resp := d.response(t)
	require.NoError(t, pki.SignJoinResponse(d.signKey, resp))
	require.Len(t, resp.Signature, ed25519.SignatureSize)

	// The signature survives the wire: it covers the decoded message, not
	// the bytes as sent.
	wire, err := proto.Marshal(resp)
	require.NoError(t, err)
	var got joinv1.JoinResponse
	require.NoError(t, proto.Unmarshal(wire, &got))
	v, err := pki.CheckJoinResponse(&got, d.pins, d.signSPKI)
	require.NoError(t, err)
	require.True(t, v.ServingCA.Equal(d.servingCA))
	require.True(t, v.NodeCA.Equal(d.nodeCA.Cert))
	require.Equal(t, resp.CertificateDer, v.Certificate.Raw)
	require.NotNil(t, v.CommandSigningRoot)
	require.NotEmpty(t, got.Signature, "checking leaves the response as it was")

	// Without signed intent there is no root, and none is made up.
	resp.Trust = nil
	require.NoError(t, pki.SignJoinResponse(d.signKey, resp))
	v, err = pki.CheckJoinResponse(resp, d.pins, d.signSPKI)
	require.NoError(t, err)
	require.Nil(t, v.CommandSigningRoot)
}

// TestCheckJoinResponseRefuses is the daemon's half of the bad joins: a
// response it must not trust, each refused with its own reason.
func TestCheckJoinResponseRefuses(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	other := newDeployment(t) // another deployment's keys and CAs
	_, otherSignSPKI, err := pki.ReadJoinPublicKeys(other.dir)
	require.NoError(t, err)

	for _, tc := range []struct {
		name string
		// make returns the response and the signing key the daemon was
		// given (e.g. from the well-known document).
		make func(t *testing.T) (*joinv1.JoinResponse, []byte)
		pins func(p pki.Pins) pki.Pins
		want string
	}{
		{name: "unsigned", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			return d.response(t), d.signSPKI
		}, want: "it is not signed"},
		{name: "bad signature", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			r.Signature[0] ^= 0x01
			return r, d.signSPKI
		}, want: "its signature does not verify with the pinned join signing key"},
		{name: "changed after signing", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			r.GatewayUrls[0] = "https://evil.example:8443"
			return r, d.signSPKI
		}, want: "its signature does not verify with the pinned join signing key"},
		{name: "gateway added after signing", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			r.GatewayUrls = append(r.GatewayUrls, "https://evil.example:8443")
			return r, d.signSPKI
		}, want: "its signature does not verify with the pinned join signing key"},
		{name: "signed by a key not matching the pin", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(other.signKey, r))
			return r, otherSignSPKI // a document that lies about the key
		}, want: "is not the pinned one"},
		{name: "signed by another key, checked with the pinned one", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(other.signKey, r))
			return r, d.signSPKI
		}, want: "its signature does not verify"},
		{name: "serving CA not matching its pin", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			r.ServingCaDer = other.servingCA.Raw
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			return r, d.signSPKI
		}, want: "serving_ca_der (" + pki.PinOfSPKI(other.servingCA.RawSubjectPublicKeyInfo) + ") does not match the serving CA pin"},
		{name: "no serving CA pin", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			return r, d.signSPKI
		}, pins: func(p pki.Pins) pki.Pins { p.ServingCA = ""; return p }, want: "no serving CA pin"},
		{name: "no join signing pin", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			return r, d.signSPKI
		}, pins: func(p pki.Pins) pki.Pins { p.JoinSigning = ""; return p }, want: "no join signing pin"},
		{name: "command-signing root not matching its pin", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			r.Trust = &joinv1.Trust{CommandSigningRoot: other.commandSPKI}
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			return r, d.signSPKI
		}, want: "trust.command_signing_root (" + pki.PinOfSPKI(other.commandSPKI) + ") does not match the command-signing pin"},
		{name: "certificate not from the node CA", make: func(t *testing.T) (*joinv1.JoinResponse, []byte) {
			r := d.response(t)
			r.NodeCaDer = other.nodeCA.Cert.Raw
			require.NoError(t, pki.SignJoinResponse(d.signKey, r))
			return r, d.signSPKI
		}, want: "certificate_der is not signed by node_ca_der"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			resp, spki := tc.make(t)
			pins := d.pins
			if tc.pins != nil {
				pins = tc.pins(pins)
			}
			v, err := pki.CheckJoinResponse(resp, pins, spki)
			require.ErrorIs(t, err, pki.ErrUntrustedJoinResponse)
			require.ErrorContains(t, err, tc.want)
			require.Nil(t, v)
		})
	}
}

func TestWellKnownJoinKeys(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	other := newDeployment(t)
	wk, err := pki.NewWellKnown(d.dir)
	require.NoError(t, err)
	require.Equal(t, d.pins, wk.Pins)
	k, err := wk.JoinKeys(d.pins)
	require.NoError(t, err)
	require.Equal(t, d.signSPKI, k.SigningSPKI)
	require.True(t, pki.MatchPin(d.pins.CommandSigning, wk.CommandSigningKey), "the document publishes the command-signing root")
	// Without a command-signing pin, the document's key is not required.
	noCmd := wk
	noCmd.CommandSigningKey = nil
	noPin := d.pins
	noPin.CommandSigning = ""
	_, err = noCmd.JoinKeys(noPin)
	require.NoError(t, err)
	// Sealing to the key of the document reaches JoinService.
	priv, err := pki.LoadJoinEncryptionKey(filepath.Join(d.dir, pki.JoinEncryptionKey))
	require.NoError(t, err)
	sealed, err := pki.SealJoinToken(k.Encryption, "bcjt_x", []byte("csr"))
	require.NoError(t, err)
	tok, err := pki.OpenJoinToken(priv, sealed, []byte("csr"))
	require.NoError(t, err)
	require.Equal(t, "bcjt_x", tok)

	otherWK, err := pki.NewWellKnown(other.dir)
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		edit func(w *pki.WellKnown, p *pki.Pins)
		want string
	}{
		{"another deployment's encryption key", func(w *pki.WellKnown, _ *pki.Pins) { w.JoinEncryptionKey = otherWK.JoinEncryptionKey },
			"does not match the join encryption pin"},
		{"another deployment's signing key", func(w *pki.WellKnown, _ *pki.Pins) { w.JoinSigningKey = otherWK.JoinSigningKey },
			"does not match the join signing pin"},
		{"another deployment's serving CA", func(w *pki.WellKnown, _ *pki.Pins) { w.ServingCA = otherWK.ServingCA },
			"servingCa (" + other.pins.ServingCA + ") does not match the serving CA pin"},
		{"no join pins", func(_ *pki.WellKnown, p *pki.Pins) { p.JoinEncryption = "" },
			"the join encryption and join signing pins are required"},
		{"encryption and signing keys swapped", func(w *pki.WellKnown, p *pki.Pins) {
			w.JoinEncryptionKey, w.JoinSigningKey = w.JoinSigningKey, w.JoinEncryptionKey
			p.JoinEncryption, p.JoinSigning = p.JoinSigning, p.JoinEncryption
		}, "join encryption key is not an X25519 key"},
		// The command-signing pin is checked before Join too, so a wrong
		// one never spends a join token.
		{"another deployment's command-signing pin", func(_ *pki.WellKnown, p *pki.Pins) { p.CommandSigning = other.pins.CommandSigning },
			"commandSigningKey: the command-signing key (" + d.pins.CommandSigning + ") does not match the command signing pin (" +
				other.pins.CommandSigning + ")"},
		{"another deployment's command-signing key", func(w *pki.WellKnown, _ *pki.Pins) { w.CommandSigningKey = otherWK.CommandSigningKey },
			"does not match the command signing pin"},
		{"a command-signing pin and no key in the document", func(w *pki.WellKnown, _ *pki.Pins) { w.CommandSigningKey = nil },
			"no command-signing key to check the command signing pin"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, p := wk, d.pins
			tc.edit(&w, &p)
			_, err := w.JoinKeys(p)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestReadPinsFile(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	pins, err := pki.ReadPins(d.dir)
	require.NoError(t, err)
	require.Equal(t, d.pins, pins)
	bad := filepath.Join(t.TempDir(), "pins.json")
	require.NoError(t, os.WriteFile(bad, []byte(`{"servingCa":"sha256/abc","joinSigning":"`+d.pins.JoinSigning+`"}`), 0o644))
	_, err = pki.ReadPinsFile(bad)
	require.ErrorContains(t, err, `servingCa: pin "sha256/abc" is not base64 of a SHA-256 digest`)
}
