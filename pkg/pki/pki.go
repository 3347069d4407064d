// Package pki holds a deployment's certificate authorities and issues the
// certificates of better-compute: node certificates (client certificates of
// the daemons, signed by the node CA, with the SPIFFE-style URI SAN
// spiffe://<trust-domain>/node/<node id>) and gateway serving certificates
// (signed by the serving CA that daemons pin).
//
// Keys are ECDSA P-256. Private keys are written owner-only (0600) and never
// logged. A deployment's files live in one directory; see Init for the names.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// DefaultTrustDomain is the SPIFFE trust domain of a deployment that names
// none.
const DefaultTrustDomain = "compute.dev.local"

// File names inside a PKI directory.
const (
	NodeCACert    = "node-ca.crt"
	NodeCAKey     = "node-ca.key"
	ServingCACert = "serving-ca.crt"
	ServingCAKey  = "serving-ca.key"
	GatewayCert   = "gateway.crt"
	GatewayKey    = "gateway.key"
	// JoinServiceCert and JoinServiceKey are JoinService's serving
	// certificate for its control listener (NodeCertService), issued by the
	// serving CA.
	JoinServiceCert = "joinservice.crt"
	JoinServiceKey  = "joinservice.key"
	TrustDomainTxt  = "trust-domain"
)

// CA is a certificate authority: its certificate and private key.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
}

// GenerateKey returns a new ECDSA P-256 key.
func GenerateKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func randomSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

// NewCA makes a self-signed CA named commonName, valid from now for validity.
func NewCA(commonName string, now time.Time, validity time.Duration) (*CA, error) {
	key, err := GenerateKey()
	if err != nil {
		return nil, err
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName, Organization: []string{"better-compute"}},
		NotBefore:             now.Add(-5 * time.Minute),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}

// Pool returns a cert pool holding only the CA's certificate.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// NodeURI returns spiffe://<trustDomain>/node/<nodeID>.
func NodeURI(trustDomain, nodeID string) *url.URL {
	return &url.URL{Scheme: "spiffe", Host: trustDomain, Path: "/node/" + nodeID}
}

// NodeIDFromCert returns the node id of a node certificate of trustDomain.
// It fails when the certificate has no URI SAN of that trust domain.
func NodeIDFromCert(cert *x509.Certificate, trustDomain string) (string, error) {
	for _, u := range cert.URIs {
		if u.Scheme == "spiffe" && u.Host == trustDomain {
			if id, ok := strings.CutPrefix(u.Path, "/node/"); ok && id != "" && !strings.Contains(id, "/") {
				return id, nil
			}
		}
	}
	return "", errors.New("certificate names no node of this trust domain")
}

// SerialHex returns a certificate's serial number in lower-case hex.
func SerialHex(cert *x509.Certificate) string { return hex.EncodeToString(cert.SerialNumber.Bytes()) }

// PublicKeySHA256 returns the SHA-256 of a certificate's SubjectPublicKeyInfo
// (its SPKI pin).
func PublicKeySHA256(cert *x509.Certificate) []byte {
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return sum[:]
}

// NewCSR makes a PKCS#10 request (DER) for key with commonName.
func NewCSR(key crypto.Signer, commonName string) ([]byte, error) {
	return x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: commonName},
	}, key)
}

// Bounds of an RSA key in a CSR, in bits: ParseCSR refuses smaller keys
// (weak) and larger ones (each costs a slow signature check).
const (
	MinRSABits = 2048
	MaxRSABits = 4096
)

// ParseCSR parses a DER CSR, checks its key (ECDSA P-256 or P-384,
// Ed25519, or RSA of MinRSABits to MaxRSABits) and then that it is signed
// by that key. Errors say which check failed.

func ParseCSR(der []byte) (*x509.CertificateRequest, error) {
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return nil, fmt.Errorf("csr is not a DER PKCS#10 request: %w", err)
	}
	// The key is checked before the signature, so that an oversized key
	// costs nothing to refuse.
	switch k := csr.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return nil, errors.New("csr ECDSA key is not on P-256 or P-384")
		}
	case ed25519.PublicKey:
	case *rsa.PublicKey:
		if n := k.N.BitLen(); n < MinRSABits || n > MaxRSABits {
			return nil, fmt.Errorf("csr RSA key has %d bits: %d to %d are accepted", n, MinRSABits, MaxRSABits)
		}
	default:
		return nil, errors.New("csr public key algorithm is not supported")
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("csr signature does not match its public key: %w", err)
	}
	return csr, nil
}

// MaxBackdate is the most a node certificate's NotBefore is set before the
// time of issue, to tolerate clock skew between the issuer and the gateway.
const MaxBackdate = 5 * time.Minute

// NodeBackdate returns how far before issue a node certificate of ttl is
// valid from: min(MaxBackdate, ttl/10). A short TTL gets a short backdate, so
// that two thirds of its lifetime (when daemons renew) are not already past
// when it is issued.
func NodeBackdate(ttl time.Duration) time.Duration { return min(MaxBackdate, ttl/10) }

// IssueNode signs a node certificate for csr: client auth, subject CN the
// node id, URI SAN NodeURI(trustDomain, nodeID), valid from
// now − NodeBackdate(ttl) until now + ttl.
func (ca *CA) IssueNode(csr *x509.CertificateRequest, nodeID, trustDomain string, now time.Time, ttl time.Duration) (*x509.Certificate, error) {
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: nodeID},
		URIs:         []*url.URL{NodeURI(trustDomain, nodeID)},
		NotBefore:    now.Add(-NodeBackdate(ttl)),
		NotAfter:     now.Add(ttl),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, csr.PublicKey, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("sign node certificate: %w", err)
	}
	return x509.ParseCertificate(der)
}

// IssueServing signs a TLS server certificate for dnsNames (IP addresses
// among them become IP SANs) with a new key, valid from now for validity.
func (ca *CA) IssueServing(dnsNames []string, now time.Time, validity time.Duration) (*x509.Certificate, crypto.Signer, error) {
	key, err := GenerateKey()
	if err != nil {
		return nil, nil, err
	}
	cert, err := ca.issueServingFor(key, dnsNames, now, validity, x509.ExtKeyUsageServerAuth)
	return cert, key, err
}

// gatewayUsages are the extended key usages of a gateway's certificate: it
// serves the machines' sessions (ServerAuth) and is the gateway's client
// certificate toward JoinService's NodeCertService (ClientAuth).
var gatewayUsages = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}

// issueServingFor signs a TLS certificate for key with the extended key
// usages (ServerAuth when none; see IssueServing).
func (ca *CA) issueServingFor(key crypto.Signer, dnsNames []string, now time.Time, validity time.Duration,
	usages ...x509.ExtKeyUsage) (*x509.Certificate, error) {
	if len(usages) == 0 {
		usages = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: firstOr(dnsNames, "gateway")},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     now.Add(validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usages,
	}
	for _, n := range dnsNames {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		return nil, fmt.Errorf("sign serving certificate: %w", err)
	}
	return x509.ParseCertificate(der)
}

func firstOr(s []string, d string) string {
	if len(s) > 0 {
		return s[0]
	}
	return d
}

// EncodeCertPEM returns cert as a PEM block.
func EncodeCertPEM(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
}

// EncodeKeyPEM returns key as a PKCS#8 PEM block.
func EncodeKeyPEM(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// ParseCertPEM parses the first certificate of a PEM file.
func ParseCertPEM(b []byte) (*x509.Certificate, error) {
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			return nil, errors.New("no CERTIFICATE block in PEM")
		}
		if blk.Type == "CERTIFICATE" {
			return x509.ParseCertificate(blk.Bytes)
		}
	}
}

// ParseKeyPEM parses a PKCS#8 (or SEC 1 EC) private key PEM block.
func ParseKeyPEM(b []byte) (crypto.Signer, error) {
	blk, _ := pem.Decode(b)
	if blk == nil {
		return nil, errors.New("no PEM block in key")
	}
	if k, err := x509.ParsePKCS8PrivateKey(blk.Bytes); err == nil {
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, errors.New("key cannot sign")
		}
		return s, nil
	}
	return x509.ParseECPrivateKey(blk.Bytes)
}

// WriteCert writes cert as PEM to path (mode 0644).
func WriteCert(path string, cert *x509.Certificate) error {
	return writeFileAtomic(path, EncodeCertPEM(cert), 0o644)
}

// WriteKey writes key as PEM to path, owner-only (mode 0600).
func WriteKey(path string, key crypto.Signer) error {
	b, err := EncodeKeyPEM(key)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, b, 0o600)
}

func writeFileAtomic(path string, b []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// LoadCA reads a CA's certificate and key from PEM files.
func LoadCA(certPath, keyPath string) (*CA, error) {
	cb, err := os.ReadFile(certPath)
	if err != nil {
		return nil, err
	}
	kb, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, err
	}
	cert, err := ParseCertPEM(cb)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", certPath, err)
	}
	key, err := ParseKeyPEM(kb)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", keyPath, err)
	}
	return &CA{Cert: cert, Key: key}, nil
}

// LoadCert reads a PEM certificate file.
func LoadCert(path string) (*x509.Certificate, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return ParseCertPEM(b)
}

// InitOptions configure Init.
type InitOptions struct {
	// TrustDomain of node certificates; DefaultTrustDomain when empty.
	TrustDomain string
	// GatewayNames are the DNS names and IPs of the gateway's serving
	// certificate; "gateway", "localhost" and 127.0.0.1 when empty.
	GatewayNames []string
	// JoinServiceNames are the DNS names and IPs of JoinService's serving
	// certificate (its control listener, which gateways reach);
	// "joinservice", "localhost" and 127.0.0.1 when empty.
	JoinServiceNames []string
}

// InitResult is what Init did.
type InitResult struct {
	// Wrote reports that Init wrote any file.
	Wrote bool
	// Warnings are problems Init fixed, one sentence each naming the file
	// (e.g. a private key readable by group or others, now 0600).
	Warnings []string
}

// privateKeyFiles are the private key files of a PKI directory.
var privateKeyFiles = []string{NodeCAKey, ServingCAKey, GatewayKey, JoinServiceKey, JoinEncryptionKey, JoinSigningKey, CommandSigningKey,
	TunnelTicketKey, SSHBreakGlassCAKey, SSHSandboxCAKey}

// Init writes a deployment's PKI into dir unless it is already there: the node
// CA, the serving CA, a gateway certificate (serving, and client of
// JoinService), JoinService's serving certificate, the trust domain,
// JoinService's HPKE key pair and signing key, the command-signing root, the
// tunnel-ticket key, the break-glass and sandbox SSH user CAs, and
// pins.json with the pins daemons check (see Pins). It creates only the files
// that are missing and never replaces an existing private key (that would
// change a pin or orphan what the key signed):
//   - a missing public file (.pub) is derived from its private key; a missing
//     gateway or JoinService certificate is issued for the existing key, and
//     so is a gateway certificate without the ClientAuth usage (made before
//     gateways were JoinService's clients);
//   - a CA certificate without its key, a key without its certificate, or a
//     public file without its private key is an error naming both files;
//   - every existing key, certificate and public file must parse, and a
//     public file or CA certificate must be its key's: errors name the file;
//   - a private key file readable by group or others is set to 0600, with a
//     warning in the result.
//
// Private keys are mode 0600; nothing secret is logged or returned.
func Init(dir string, opts InitOptions, now time.Time) (InitResult, error) {
	var res InitResult
	if opts.TrustDomain == "" {
		opts.TrustDomain = DefaultTrustDomain
	}
	if len(opts.GatewayNames) == 0 {
		opts.GatewayNames = []string{"gateway", "localhost", "127.0.0.1"}
	}
	if len(opts.JoinServiceNames) == 0 {
		opts.JoinServiceNames = []string{"joinservice", "localhost", "127.0.0.1"}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return res, err
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	for _, k := range privateKeyFiles {
		st, err := os.Stat(p(k))
		if err != nil || st.Mode().Perm()&0o077 == 0 {
			continue
		}
		if err := os.Chmod(p(k), 0o600); err != nil {
			return res, fmt.Errorf("%s: %w", p(k), err)
		}
		res.Warnings = append(res.Warnings, fmt.Sprintf("%s was mode %04o (readable by group or others); set it to 0600",
			p(k), st.Mode().Perm()))
	}
	if !exists(p(TrustDomainTxt)) {
		if err := writeFileAtomic(p(TrustDomainTxt), []byte(opts.TrustDomain+"\n"), 0o644); err != nil {
			return res, err
		}
		res.Wrote = true
	}
	for _, c := range []struct{ crt, key, cn string }{
		{NodeCACert, NodeCAKey, "better-compute node CA"},
		{ServingCACert, ServingCAKey, "better-compute serving CA"},
	} {
		switch crtOK, keyOK := exists(p(c.crt)), exists(p(c.key)); {
		case crtOK && keyOK:
			if _, err := loadMatchingCA(p(c.crt), p(c.key)); err != nil {
				return res, err
			}
			continue
		case crtOK || keyOK:
			missing, present := p(c.crt), p(c.key)
			if crtOK {
				missing, present = present, missing
			}
			return res, fmt.Errorf("%s is missing but %s exists: restore it from a backup, or remove both to make a new CA "+
				"(which changes its pin and invalidates what the old one signed)", missing, present)
		}
		ca, err := NewCA(c.cn, now, 10*365*24*time.Hour)
		if err != nil {
			return res, err
		}
		if err := WriteKey(p(c.key), ca.Key); err != nil {
			return res, err
		}
		if err := WriteCert(p(c.crt), ca.Cert); err != nil {
			return res, err
		}
		// A new serving CA invalidates any old gateway and JoinService
		// certificate.
		if c.crt == ServingCACert {
			_ = os.Remove(p(GatewayCert))
			_ = os.Remove(p(JoinServiceCert))
		}
		res.Wrote = true
	}
	for _, c := range []struct {
		crt, key string
		names    []string
		usages   []x509.ExtKeyUsage
	}{
		{GatewayCert, GatewayKey, opts.GatewayNames, gatewayUsages},
		{JoinServiceCert, JoinServiceKey, opts.JoinServiceNames, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}},
	} {
		wrote, err := initServing(dir, c.crt, c.key, c.names, c.usages, now)
		if err != nil {
			return res, err
		}
		res.Wrote = res.Wrote || wrote
	}
	trustWrote, err := initTrustKeys(dir)
	if err != nil {
		return res, err
	}
	res.Wrote = res.Wrote || trustWrote
	return res, nil
}

// loadMatchingCA loads a CA and checks that the certificate is the key's.
func loadMatchingCA(crt, key string) (*CA, error) {
	ca, err := LoadCA(crt, key)
	if err != nil {
		return nil, err
	}
	if !publicKeysEqual(ca.Key.Public(), ca.Cert.PublicKey) {
		return nil, fmt.Errorf("%s does not match %s", crt, key)
	}
	return ca, nil
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	k, ok := a.(interface{ Equal(x crypto.PublicKey) bool })
	return ok && k.Equal(b)
}

// initServing makes the serving certificate crt of a service, signed by
// the serving CA for names with usages, when it is missing or lacks one of
// usages: for the existing key if there is one (it is never replaced), else
// for a new key. Existing files must parse; errors name the file.
func initServing(dir, crt, keyFile string, names []string, usages []x509.ExtKeyUsage, now time.Time) (bool, error) {
	p := func(n string) string { return filepath.Join(dir, n) }
	var key crypto.Signer
	if exists(p(keyFile)) {
		b, err := os.ReadFile(p(keyFile))
		if err != nil {
			return false, err
		}
		if key, err = ParseKeyPEM(b); err != nil {
			return false, fmt.Errorf("%s: %w", p(keyFile), err)
		}
	}
	if exists(p(crt)) {
		cert, err := LoadCert(p(crt))
		if err != nil {
			return false, fmt.Errorf("%s: %w", p(crt), err)
		}
		if key != nil {
			if !publicKeysEqual(key.Public(), cert.PublicKey) {
				return false, fmt.Errorf("%s does not match %s", p(crt), p(keyFile))
			}
			if hasUsages(cert, usages) {
				return false, nil
			}
		}
	}
	sca, err := loadMatchingCA(p(ServingCACert), p(ServingCAKey))
	if err != nil {
		return false, err
	}
	newKey := key == nil
	if newKey {
		if key, err = GenerateKey(); err != nil {
			return false, err
		}
	}
	cert, err := sca.issueServingFor(key, names, now, 2*365*24*time.Hour, usages...)
	if err != nil {
		return false, err
	}
	if newKey {
		if err := WriteKey(p(keyFile), key); err != nil {
			return false, err
		}
	}
	if err := WriteCert(p(crt), cert); err != nil {
		return false, err
	}
	return true, nil
}

// hasUsages reports whether cert has every extended key usage of usages.
func hasUsages(cert *x509.Certificate, usages []x509.ExtKeyUsage) bool {
	for _, u := range usages {
		if !slices.Contains(cert.ExtKeyUsage, u) {
			return false
		}
	}
	return true
}

// ReadTrustDomain reads the trust domain file of a PKI directory.
func ReadTrustDomain(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, TrustDomainTxt))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
