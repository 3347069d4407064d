// Package sshca is both ends of the deployment's SSH user certificates
// (docs/architecture.md, "Tunnels"): the API issues them from the
// break-glass and sandbox CAs (pkg/pki SSHBreakGlassCAKey, SSHSandboxCAKey),
// and a node's SSH server accepts a login only with a certificate that
// Authorize accepts. Certificates are OpenSSH's (PROTOCOL.certkeys), so the
// real OpenSSH client presents them.
//
// The rules, which both ends share through this package:
//   - every certificate carries the critical option NodeOption, whose value
//     is the one node id it is valid on;
//   - a break-glass certificate's principal is "root";
//   - a sandbox certificate's principal is a reservation id, and a node
//     accepts it while that reservation is in its NodeSpec (released, it
//     stops working);
//   - at most MaxTTL long.
package sshca

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
)

// The CAs, by the name NodeSpecs and audit rows give them.
const (
	BreakGlass = "break-glass"
	Sandbox    = "sandbox"
)

// NodeOption is the critical option binding a certificate to one node: its
// value is the node id. An SSH server that does not know it refuses the
// certificate, as OpenSSH's rules for critical options ask.
const NodeOption = "node@better-compute"

// RootPrincipal is the principal of break-glass certificates.
const RootPrincipal = "root"

// Lifetimes of a certificate.
const (
	DefaultTTL = 15 * time.Minute
	MaxTTL     = time.Hour
	// backdate is how far before now a certificate becomes valid, for the
	// clocks of the node and the issuer not to agree exactly.
	backdate = time.Minute
)

// CA is one of the deployment's SSH user CAs.
type CA struct {
	// Name is BreakGlass or Sandbox.
	Name   string
	signer ssh.Signer
}

// LoadCA reads the CA name (BreakGlass or Sandbox) from the PKI directory
// dir.
func LoadCA(dir, name string) (*CA, error) {
	file := pki.SSHBreakGlassCAKey
	switch name {
	case BreakGlass:
	case Sandbox:
		file = pki.SSHSandboxCAKey
	default:
		return nil, fmt.Errorf("sshca: unknown CA %q", name)
	}
	key, err := pki.LoadSigningKey(filepath.Join(dir, file))
	if err != nil {
		return nil, err
	}
	return NewCA(name, key)
}

// NewCA returns the CA name signing with key.
func NewCA(name string, key ed25519.PrivateKey) (*CA, error) {
	s, err := ssh.NewSignerFromKey(key)
	if err != nil {
		return nil, fmt.Errorf("sshca: %w", err)
	}
	return &CA{Name: name, signer: s}, nil
}

// PublicKey returns the CA's public key in authorized_keys format, as a
// NodeSpec carries it.
func (ca *CA) PublicKey() string { return MarshalPublicKey(ca.signer.PublicKey()) }

// UserCA returns the CA as a NodeSpec names it.
func (ca *CA) UserCA() *gatewayv1.SshUserCa {
	return &gatewayv1.SshUserCa{Name: ca.Name, PublicKey: ca.PublicKey()}
}

// Request is a certificate to issue.
type Request struct {
	// Key is the user's public key.
	Key ssh.PublicKey
	// NodeID is the node the certificate is bound to.
	NodeID string
	// Principal is RootPrincipal (break-glass) or a reservation id
	// (sandbox).
	Principal string
	// KeyID names the caller and the node, for the node's logs and the
	// audit.
	KeyID string
	// ValidBefore is when it stops being valid (at most MaxTTL from now).
	ValidBefore time.Time
}

// Issue signs a certificate for r at now with a random serial. Errors: a
// principal that does not fit the CA, a validity that is not in the
// future or longer than MaxTTL, no node.
func (ca *CA) Issue(r Request, now time.Time) (*ssh.Certificate, error) {
	switch {
	case r.NodeID == "":
		return nil, errors.New("sshca: no node")
	case ca.Name == BreakGlass && r.Principal != RootPrincipal:
		return nil, fmt.Errorf("sshca: a break-glass certificate is for %s, not %q", RootPrincipal, r.Principal)
	case ca.Name == Sandbox && (r.Principal == "" || r.Principal == RootPrincipal):
		return nil, fmt.Errorf("sshca: a sandbox certificate is for a reservation, not %q", r.Principal)
	case !r.ValidBefore.After(now):
		return nil, errors.New("sshca: the certificate would already be expired")
	case r.ValidBefore.Sub(now) > MaxTTL:
		return nil, fmt.Errorf("sshca: a certificate is valid at most %s", MaxTTL)
	}
	var serial [8]byte
	if _, err := rand.Read(serial[:]); err != nil {
		return nil, err
	}
	cert := &ssh.Certificate{
		Key:             r.Key,
		Serial:          binary.BigEndian.Uint64(serial[:]),
		CertType:        ssh.UserCert,
		KeyId:           r.KeyID,
		ValidPrincipals: []string{r.Principal},
		ValidAfter:      uint64(now.Add(-backdate).Unix()),
		ValidBefore:     uint64(r.ValidBefore.Unix()),
		Permissions: ssh.Permissions{
			CriticalOptions: map[string]string{NodeOption: r.NodeID},
			Extensions:      map[string]string{"permit-pty": ""},
		},
	}
	if err := cert.SignCert(rand.Reader, ca.signer); err != nil {
		return nil, fmt.Errorf("sshca: sign: %w", err)
	}
	return cert, nil
}

// MarshalPublicKey returns k in authorized_keys format, without a newline.
func MarshalPublicKey(k ssh.PublicKey) string {
	return strings.TrimSuffix(string(ssh.MarshalAuthorizedKey(k)), "\n")
}

// MinRSABits is the smallest RSA user key ParseUserKey accepts, in bits:
// 2048, the least NIST SP 800-57 Part 1 (rev. 5, table 2) allows for use
// now.
const MinRSABits = 2048

// ParseUserKey parses a user's public key in authorized_keys format (one
// key; a comment is allowed): Ed25519, ECDSA (P-256, P-384, P-521), their
// security-key forms, or RSA of at least MinRSABits. A certificate is not
// a user key, and DSA (ssh-dss: 1024 bits, which OpenSSH no longer
// accepts) is refused. Errors say what the text is not or what the key
// lacks, for the caller to put after the field or flag that held it.
func ParseUserKey(text string) (ssh.PublicKey, error) {
	key, _, _, rest, err := ssh.ParseAuthorizedKey([]byte(text))
	if err != nil {
		return nil, errors.New("not an SSH public key (authorized_keys format, e.g. \"ssh-ed25519 AAAA… comment\")")
	}
	if len(strings.TrimSpace(string(rest))) > 0 {
		return nil, errors.New("more than one SSH public key")
	}
	if _, ok := key.(*ssh.Certificate); ok {
		return nil, errors.New("a certificate, not a public key")
	}
	if key.Type() == ssh.KeyAlgoDSA { //nolint:staticcheck // named to be refused
		return nil, errors.New("a DSA key (ssh-dss): use Ed25519, ECDSA or RSA of at least 2048 bits")
	}
	if ck, ok := key.(ssh.CryptoPublicKey); ok {
		if rk, ok := ck.CryptoPublicKey().(*rsa.PublicKey); ok && rk.N.BitLen() < MinRSABits {
			return nil, fmt.Errorf("an RSA key of %d bits: at least %d are needed", rk.N.BitLen(), MinRSABits)
		}
	}
	return key, nil
}

// Authority is a CA a node trusts, from its NodeSpec.
type Authority struct {
	Name string
	Key  ssh.PublicKey
}

// Authorities parses the CAs of a NodeSpec; a CA that does not parse or
// has an unknown name is an error (the spec is refused).
func Authorities(cas []*gatewayv1.SshUserCa) ([]Authority, error) {
	out := make([]Authority, 0, len(cas))
	for _, ca := range cas {
		if ca.GetName() != BreakGlass && ca.GetName() != Sandbox {
			return nil, fmt.Errorf("ssh user CA %q: unknown name", ca.GetName())
		}
		k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(ca.GetPublicKey()))
		if err != nil {
			return nil, fmt.Errorf("ssh user CA %s: %w", ca.GetName(), err)
		}
		out = append(out, Authority{Name: ca.GetName(), Key: k})
	}
	return out, nil
}

// Login is what a node knows when a client offers a key.
type Login struct {
	// User is the user the client logs in as (root, or a reservation id).
	User string
	// Key is the key the client offered.
	Key ssh.PublicKey
	// NodeID is the node's own id.
	NodeID string
	// Authorities are the CAs of the node's current NodeSpec.
	Authorities []Authority
	// Reservations reports whether a reservation is in the node's current
	// NodeSpec (a sandbox certificate's principal).
	Reservations func(id string) bool
	// Now is the node's time.
	Now time.Time
}

// Refusal is why Authorize refused a login, for the node's event.
type Refusal struct {
	Reason string
	// KeyID is the certificate's key id, empty for a plain key.
	KeyID string
}

func (r *Refusal) Error() string { return r.Reason }

// Authorize accepts l when its key is a user certificate signed by one of
// the node's Authorities, for l.User as that CA's rules say (see the
// package comment), bound to l.NodeID by NodeOption, valid at l.Now, with
// no critical option but NodeOption; it returns the CA's name. Anything
// else is a *Refusal saying why.
func Authorize(l Login) (string, error) {
	cert, ok := l.Key.(*ssh.Certificate)
	if !ok {
		return "", &Refusal{Reason: "not a certificate: only certificates from the deployment's SSH CAs are accepted"}
	}
	refuse := func(format string, args ...any) (string, error) {
		return "", &Refusal{Reason: fmt.Sprintf(format, args...), KeyID: cert.KeyId}
	}
	if cert.CertType != ssh.UserCert {
		return refuse("not a user certificate")
	}
	i := slices.IndexFunc(l.Authorities, func(a Authority) bool {
		return string(a.Key.Marshal()) == string(cert.SignatureKey.Marshal())
	})
	if i < 0 {
		return refuse("signed by a CA this node does not trust")
	}
	ca := l.Authorities[i]
	// CheckCert verifies the signature, the validity period, the principal
	// and that every critical option is one it supports.
	checker := &ssh.CertChecker{
		SupportedCriticalOptions: []string{NodeOption},
		Clock:                    func() time.Time { return l.Now },
	}
	if err := checker.CheckCert(l.User, cert); err != nil {
		return refuse("%v", err)
	}
	if node := cert.CriticalOptions[NodeOption]; node != l.NodeID {
		if node == "" {
			return refuse("not bound to a node")
		}
		return refuse("bound to node %s, not this node", node)
	}
	switch ca.Name {
	case BreakGlass:
		if l.User != RootPrincipal {
			return refuse("a break-glass certificate logs in as %s only", RootPrincipal)
		}
	case Sandbox:
		if l.User == RootPrincipal || l.Reservations == nil || !l.Reservations(l.User) {
			return refuse("reservation %s is not on this node", l.User)
		}
	}
	return ca.Name, nil
}
