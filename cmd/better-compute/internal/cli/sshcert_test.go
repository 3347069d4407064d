package cli_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/sshca"
)

// parseCert parses an OpenSSH certificate in authorized_keys format.
func parseCert(t *testing.T, text string) *ssh.Certificate {
	t.Helper()
	k, _, _, rest, err := ssh.ParseAuthorizedKey([]byte(text))
	require.NoError(t, err)
	require.Empty(t, strings.TrimSpace(string(rest)))
	cert, ok := k.(*ssh.Certificate)
	require.True(t, ok, "a certificate")
	return cert
}

// TestSSHCert: the certificate lands next to the key, where OpenSSH looks
// for it, and what was issued is printed.
func TestSSHCert(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	dir := t.TempDir()
	keyText, key := sshPublicKey(t)
	keyFile := filepath.Join(dir, "id_ed25519.pub")
	require.NoError(t, os.WriteFile(keyFile, []byte(keyText), 0o644))

	res := runner{env: f.env()}.run(t, "ssh-cert", "--node", f.node, "--public-key", keyFile)
	require.Equal(t, 0, res.code, res.stderr)
	certFile := filepath.Join(dir, "id_ed25519-cert.pub")
	st, err := os.Stat(certFile)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o644), st.Mode().Perm())
	b, err := os.ReadFile(certFile)
	require.NoError(t, err)
	cert := parseCert(t, string(b))
	require.Equal(t, key.Marshal(), cert.Key.Marshal())
	require.Equal(t, []string{sshca.RootPrincipal}, cert.ValidPrincipals)
	require.Equal(t, f.node, cert.CriticalOptions[sshca.NodeOption])

	reqs := f.certRequestsSeen()
	require.Len(t, reqs, 1)
	require.Equal(t, strings.TrimSpace(keyText), reqs[0].GetPublicKey(), "the key as written, with its comment")
	require.Equal(t, 15*time.Minute, reqs[0].GetTtl().AsDuration())
	require.Empty(t, reqs[0].GetReservationId())

	validBefore := time.Unix(int64(cert.ValidBefore), 0).UTC().Format(time.RFC3339)
	require.Contains(t, res.stdout, "wrote "+certFile+"\n")
	require.Contains(t, res.stdout, "serial:       "+formatUint(cert.Serial)+"\n")
	require.Contains(t, res.stdout, "key id:       "+cert.KeyId+"\n")
	require.Contains(t, res.stdout, "principals:   root\n")
	require.Contains(t, res.stdout, "valid until:  "+validBefore+" (16m0s from ")
	require.Contains(t, res.stdout, "ca:           break-glass\n")
	require.Empty(t, res.stderr)
}

func formatUint(n uint64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// TestSSHCertSandboxJSON: --reservation asks for a sandbox certificate,
// --ttl for its length, --cert-file for its file, -o json for the answer.
func TestSSHCertSandboxJSON(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	dir := t.TempDir()
	keyText, key := sshPublicKey(t)
	keyFile := filepath.Join(dir, "key.pub")
	require.NoError(t, os.WriteFile(keyFile, []byte(keyText), 0o644))
	resID := f.reservation
	certFile := filepath.Join(dir, "sandbox-cert.pub")

	res := runner{env: f.env()}.run(t, "ssh-cert", "--node", f.node, "--public-key", keyFile, "--reservation", resID,
		"--ttl", "1800", "--cert-file", certFile, "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var out map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &out), res.stdout)
	b, err := os.ReadFile(certFile)
	require.NoError(t, err)
	require.Equal(t, strings.TrimSpace(string(b)), out["certificate"])
	cert := parseCert(t, string(b))
	require.Equal(t, key.Marshal(), cert.Key.Marshal())
	require.Equal(t, certFile, out["file"])
	require.Equal(t, formatUint(cert.Serial), out["serial"])
	require.Equal(t, cert.KeyId, out["keyId"])
	require.Equal(t, []any{resID}, out["principals"])
	require.Equal(t, "sandbox", out["ca"])
	for _, k := range []string{"validAfter", "validBefore"} {
		_, err := time.Parse(time.RFC3339, out[k].(string))
		require.NoError(t, err, k)
	}
	require.NoFileExists(t, filepath.Join(dir, "key-cert.pub"))
	reqs := f.certRequestsSeen()
	require.Len(t, reqs, 1)
	require.Equal(t, 30*time.Minute, reqs[0].GetTtl().AsDuration())
	require.Equal(t, resID, reqs[0].GetReservationId())

	// --cert-file - prints the certificate alone on stdout, the rest on
	// stderr.
	res = runner{env: f.env()}.run(t, "ssh-cert", "--node", f.node, "--public-key", keyFile, "--cert-file", "-")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, 1, strings.Count(res.stdout, "\n"))
	require.Equal(t, key.Marshal(), parseCert(t, res.stdout).Key.Marshal())
	require.Contains(t, res.stderr, "principals:   root\n")
	require.NotContains(t, res.stderr, "wrote")
}

// TestSSHCertReservationNode: with --reservation, --node defaults to the
// reservation's node (the README's `ssh-cert --reservation res_…`); a
// --node that is another node, a reservation on no node yet, and neither
// flag are refused, asking the API for nothing.
func TestSSHCertReservationNode(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	dir := t.TempDir()
	keyText, _ := sshPublicKey(t)
	keyFile := filepath.Join(dir, "id_ed25519.pub")
	require.NoError(t, os.WriteFile(keyFile, []byte(keyText), 0o644))

	res := runner{env: f.env()}.run(t, "ssh-cert", "--reservation", strings.ToLower(f.reservation), "--public-key", keyFile)
	require.Equal(t, 0, res.code, res.stderr)
	reqs := f.certRequestsSeen()
	require.Len(t, reqs, 1)
	require.Equal(t, f.node, reqs[0].GetNodeId())
	require.Equal(t, f.reservation, reqs[0].GetReservationId())
	res = runner{env: f.env()}.run(t, "ssh-cert", "--reservation", f.reservation, "--node", strings.ToLower(f.node),
		"--public-key", keyFile)
	require.Equal(t, 0, res.code, res.stderr)
	require.Len(t, f.certRequestsSeen(), 2)

	other := ids.New(ids.Node, clock.New().Now())
	for _, tc := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"--reservation", f.reservation, "--node", other}, "error: --node " + other + " is not the node of reservation " +
			f.reservation + " (" + f.node + "): drop --node, or give --node " + f.node + "\n"},
		{[]string{"--reservation", f.pending}, "error: reservation " + f.pending + " is pending and on no node yet: " +
			"its sandbox opens once it is active\n"},
		{nil, "error: required flag(s) \"node\" not set: give --node, or --reservation (its node is the default)\n"},
	} {
		res := runner{env: f.env()}.run(t, append([]string{"ssh-cert", "--public-key", keyFile}, tc.args...)...)
		require.Equal(t, 1, res.code, tc.args)
		require.Equal(t, tc.stderr, res.stderr, tc.args)
	}
	require.Len(t, f.certRequestsSeen(), 2)
	require.NoFileExists(t, filepath.Join(dir, "id_ed25519-cert.pub.tmp"))
}

// TestSSHCertFlagErrors: a bad key file or --ttl is refused before the API
// is asked, naming the flag; no file is written.
func TestSSHCertFlagErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	keyText, _ := sshPublicKey(t)
	good := filepath.Join(dir, "good.pub")
	require.NoError(t, os.WriteFile(good, []byte(keyText), 0o644))
	notKey := filepath.Join(dir, "notes.pub")
	require.NoError(t, os.WriteFile(notKey, []byte("hello\n"), 0o644))
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	block, err := ssh.MarshalPrivateKey(priv, "")
	require.NoError(t, err)
	private := filepath.Join(dir, "id_ed25519")
	require.NoError(t, os.WriteFile(private, pem.EncodeToMemory(block), 0o600))
	f := newFakeTunnels(t)
	cert := parseCertText(t, f, good)
	certFile := filepath.Join(dir, "cert-cert.pub")
	require.NoError(t, os.WriteFile(certFile, []byte(cert+"\n"), 0o644))
	before := len(f.certRequestsSeen())

	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"no such file", []string{"--public-key", filepath.Join(dir, "nope.pub")},
			"error: --public-key: open " + filepath.Join(dir, "nope.pub") + ": no such file or directory\n"},
		{"not a key", []string{"--public-key", notKey}, "error: --public-key " + notKey + ": not an SSH public key"},
		{"a private key", []string{"--public-key", private},
			"error: --public-key " + private + ": a private key, not a public key: pass the .pub file beside it\n"},
		{"a certificate", []string{"--public-key", certFile}, "error: --public-key " + certFile + ": a certificate, not a public key\n"},
		{"ttl 0", []string{"--public-key", good, "--ttl", "0"}, "error: --ttl must be positive (1s to 1h), got 0s\n"},
		{"ttl 2h", []string{"--public-key", good, "--ttl", "2h"}, "error: --ttl must be at most 1h, got 2h0m0s\n"},
		{"ttl 1d", []string{"--public-key", good, "--ttl", "1d"}, "error: --ttl must be at most 1h, got 24h0m0s\n"},
		{"ttl 1.5s", []string{"--public-key", good, "--ttl", "1.5s"}, "error: --ttl must be a whole number of seconds, got 1.5s\n"},
		{"ttl soon", []string{"--public-key", good, "--ttl", "soon"}, "error: invalid argument \"soon\" for \"--ttl\" flag: " +
			"want a duration such as 90m, 24h or 7d, or a number of seconds (see 'better-compute ssh-cert --help')\n"},
		{"no key", nil, "error: required flag(s) \"public-key\" not set\n"},
		// Read up to the bound only: an endless file ends at once.
		{"endless", []string{"--public-key", "/dev/zero"}, "error: --public-key /dev/zero: more than 16384 bytes: not an SSH public key\n"},
		{"a directory", []string{"--public-key", dir}, "error: --public-key " + dir + ": a directory, not a public key file\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := runner{env: f.env()}.run(t, append([]string{"ssh-cert", "--node", f.node}, tc.args...)...)
			require.Equal(t, 1, res.code)
			require.True(t, strings.HasPrefix(res.stderr, tc.stderr), "stderr %q should start with %q", res.stderr, tc.stderr)
			require.Empty(t, res.stdout)
			require.NotContains(t, res.stderr, "PRIVATE KEY", "a private key's text is never printed")
		})
	}
	require.Len(t, f.certRequestsSeen(), before, "the API was not asked")
	require.NoFileExists(t, filepath.Join(dir, "good-cert.pub"))
}

// parseCertText issues a certificate for the key in file through the CLI
// and returns it.
func parseCertText(t *testing.T, f *fakeTunnels, file string) string {
	t.Helper()
	res := runner{env: f.env()}.run(t, "ssh-cert", "--node", f.node, "--public-key", file, "--cert-file", "-")
	require.Equal(t, 0, res.code, res.stderr)
	return strings.TrimSpace(res.stdout)
}

func (f *fakeTunnels) certRequestsSeen() []*computev1.IssueSshCertificateRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*computev1.IssueSshCertificateRequest(nil), f.certRequests...)
}

// sshPublicKey returns a new ed25519 key's public half in authorized_keys
// format, with a comment.
func sshPublicKey(t *testing.T) (string, ssh.PublicKey) {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	k, err := ssh.NewPublicKey(pub)
	require.NoError(t, err)
	return sshca.MarshalPublicKey(k) + " user@laptop\n", k
}
