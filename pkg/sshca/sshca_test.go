package sshca_test

import (
	"crypto/dsa" //nolint:staticcheck // DSA keys are made here to check that they are refused
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/sshca"
)

func newCA(t *testing.T, name string) *sshca.CA {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	ca, err := sshca.NewCA(name, key)
	require.NoError(t, err)
	return ca
}

func userKey(t *testing.T) ssh.PublicKey {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	k, err := ssh.NewPublicKey(pub)
	require.NoError(t, err)
	return k
}

func TestIssueAndAuthorize(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	breakGlass, sandbox, stranger := newCA(t, sshca.BreakGlass), newCA(t, sshca.Sandbox), newCA(t, sshca.BreakGlass)
	authorities, err := sshca.Authorities([]*gatewayv1.SshUserCa{breakGlass.UserCA(), sandbox.UserCA()})
	require.NoError(t, err)
	key := userKey(t)
	issue := func(ca *sshca.CA, node, principal string, ttl time.Duration) ssh.PublicKey {
		cert, err := ca.Issue(sshca.Request{Key: key, NodeID: node, Principal: principal, KeyID: "tok_1 on " + node,
			ValidBefore: now.Add(ttl)}, now)
		require.NoError(t, err)
		require.Equal(t, []string{principal}, cert.ValidPrincipals)
		require.Equal(t, node, cert.CriticalOptions[sshca.NodeOption])
		return cert
	}
	onNode := map[string]bool{"res_on": true}
	login := func(user string, k ssh.PublicKey, at time.Time) (string, error) {
		return sshca.Authorize(sshca.Login{User: user, Key: k, NodeID: "node_1", Authorities: authorities,
			Reservations: func(id string) bool { return onNode[id] }, Now: at})
	}
	for _, tc := range []struct {
		name   string
		user   string
		key    ssh.PublicKey
		at     time.Time
		ca     string
		reason string
	}{
		{"break-glass", "root", issue(breakGlass, "node_1", "root", time.Hour), now, sshca.BreakGlass, ""},
		{"sandbox", "res_on", issue(sandbox, "node_1", "res_on", time.Hour), now, sshca.Sandbox, ""},
		{"another node's", "root", issue(breakGlass, "node_2", "root", time.Hour), now, "", "bound to node node_2, not this node"},
		{"expired", "root", issue(breakGlass, "node_1", "root", time.Minute), now.Add(2 * time.Minute), "", "expired"},
		{"unknown CA", "root", issue(stranger, "node_1", "root", time.Hour), now, "", "signed by a CA this node does not trust"},
		{"plain key", "root", key, now, "", "not a certificate"},
		{"break-glass as another user", "res_on", issue(breakGlass, "node_1", "root", time.Hour), now, "", "not in the set of valid principals"},
		{"sandbox as root", "root", issue(sandbox, "node_1", "res_on", time.Hour), now, "", "not in the set of valid principals"},
		{"released sandbox", "res_gone", issue(sandbox, "node_1", "res_gone", time.Hour), now, "", "reservation res_gone is not on this node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ca, err := login(tc.user, tc.key, tc.at)
			if tc.reason == "" {
				require.NoError(t, err)
				require.Equal(t, tc.ca, ca)
				return
			}
			var r *sshca.Refusal
			require.True(t, errors.As(err, &r), "%v", err)
			require.Contains(t, r.Reason, tc.reason)
		})
	}

	// What the CAs refuse to issue.
	for name, r := range map[string]sshca.Request{
		"break-glass for a reservation": {Key: key, NodeID: "node_1", Principal: "res_1", ValidBefore: now.Add(time.Hour)},
		"no node":                       {Key: key, Principal: "root", ValidBefore: now.Add(time.Hour)},
		"too long":                      {Key: key, NodeID: "node_1", Principal: "root", ValidBefore: now.Add(sshca.MaxTTL + time.Second)},
		"already expired":               {Key: key, NodeID: "node_1", Principal: "root", ValidBefore: now},
	} {
		_, err := breakGlass.Issue(r, now)
		require.Error(t, err, name)
	}
	_, err = sandbox.Issue(sshca.Request{Key: key, NodeID: "node_1", Principal: "root", ValidBefore: now.Add(time.Hour)}, now)
	require.Error(t, err, "a sandbox certificate is for a reservation")
}

func TestParseUserKey(t *testing.T) {
	t.Parallel()
	key := userKey(t)
	line := sshca.MarshalPublicKey(key) + " me@laptop"
	got, err := sshca.ParseUserKey(line + "\n")
	require.NoError(t, err)
	require.Equal(t, key.Marshal(), got.Marshal())
	for name, text := range map[string]string{
		"garbage":  "hello",
		"two keys": line + "\n" + line + "\n",
		"empty":    "",
	} {
		_, err := sshca.ParseUserKey(text)
		require.Error(t, err, name)
	}
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	cert, err := newCA(t, sshca.BreakGlass).Issue(sshca.Request{Key: key, NodeID: "node_1", Principal: "root",
		ValidBefore: now.Add(time.Hour)}, now)
	require.NoError(t, err)
	_, err = sshca.ParseUserKey(sshca.MarshalPublicKey(cert))
	require.ErrorContains(t, err, "a certificate")

	// Key types and sizes: RSA of at least 2048 bits, ECDSA, Ed25519.
	for _, c := range []struct {
		name string
		key  func(t *testing.T) any
		err  string
	}{
		{name: "rsa 1024", key: rsaKey(1024), err: "an RSA key of 1024 bits: at least 2048 are needed"},
		{name: "rsa 2047", key: rsaKey(2047), err: "an RSA key of 2047 bits: at least 2048 are needed"},
		{name: "rsa 2048", key: rsaKey(2048)},
		{name: "ecdsa p256", key: func(t *testing.T) any {
			k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			require.NoError(t, err)
			return &k.PublicKey
		}},
		{name: "dsa", key: func(t *testing.T) any {
			var k dsa.PrivateKey
			require.NoError(t, dsa.GenerateParameters(&k.Parameters, rand.Reader, dsa.L1024N160))
			require.NoError(t, dsa.GenerateKey(&k, rand.Reader))
			return &k.PublicKey
		}, err: "a DSA key (ssh-dss): use Ed25519, ECDSA or RSA of at least 2048 bits"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			k, err := ssh.NewPublicKey(c.key(t))
			require.NoError(t, err)
			_, err = sshca.ParseUserKey(sshca.MarshalPublicKey(k))
			if c.err == "" {
				require.NoError(t, err)
				return
			}
			require.EqualError(t, err, c.err)
		})
	}
	_, err = sshca.Authorities([]*gatewayv1.SshUserCa{{Name: "other", PublicKey: line}})
	require.ErrorContains(t, err, "unknown name")
}

// rsaKey returns a maker of an RSA public key of bits bits.
func rsaKey(bits int) func(t *testing.T) any {
	return func(t *testing.T) any {
		t.Helper()
		k, err := rsa.GenerateKey(rand.Reader, bits)
		require.NoError(t, err)
		return &k.PublicKey
	}
}
