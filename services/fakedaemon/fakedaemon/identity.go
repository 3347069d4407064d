package fakedaemon

import (
	"crypto"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/better-compute/better-compute/pkg/pki"
)

// Files of a machine's directory (besides the journal's).
const (
	// MachineIDFile holds the machine id: 32 random hex characters made on
	// first start, the seed of the fake hardware's GPU UUIDs.
	MachineIDFile = "machine-id"
	// KeyFile is the node's private key (PEM, mode 0600), made before the
	// first Join so a retried Join reuses it.
	KeyFile = "node.key"
	// CertFile is the node certificate (PEM).
	CertFile = "node.crt"
	// NodeCAFile is the node CA certificate from the JoinResponse (PEM).
	NodeCAFile = "node-ca.crt"
	// ServingCAFile is the CA of gateway serving certificates (PEM).
	ServingCAFile = "serving-ca.crt"
	// NodeFile is the node's identity (JSON); it is written last, so its
	// presence means the Join completed.
	NodeFile = "node.json"
	// BootFile holds the boot counter; every start of the process is a boot.
	BootFile = "boot"
)

// Identity is what a machine keeps on disk after joining.
type Identity struct {
	// NodeID is the node's id ("node_…").
	NodeID string `json:"node_id"`
	// MachineID is the machine's stable id.
	MachineID string `json:"machine_id"`
	// Variant is the fake hardware variant the machine joined with.
	Variant string `json:"variant"`
	// GatewayURL is where the node opens its Session.
	GatewayURL string `json:"gateway_url"`
	// GatewayServerName is the TLS server name of the gateway ("" means the
	// host of the gateway URL).
	GatewayServerName string `json:"gateway_server_name,omitempty"`
	// TrustDomain is the SPIFFE trust domain of the node certificate.
	TrustDomain string `json:"trust_domain,omitempty"`
	// PoolID is the pool the node joined.
	PoolID string `json:"pool_id,omitempty"`
	// NotAfter is when the node certificate expires.
	NotAfter time.Time `json:"not_after,omitzero"`
	// JoinedAt is when the Join completed.
	JoinedAt time.Time `json:"joined_at"`

	key       crypto.Signer
	cert      *x509.Certificate
	servingCA *x509.Certificate
}

// loadOrCreateMachineID returns the machine id in dir, creating it on first
// use.
func loadOrCreateMachineID(dir string) (string, error) {
	path := filepath.Join(dir, MachineIDFile)
	b, err := os.ReadFile(path)
	if err == nil {
		if id := strings.TrimSpace(string(b)); id != "" {
			return id, nil
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", err
	}
	var raw [16]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	id := hex.EncodeToString(raw[:])
	if err := writeFileSync(path, []byte(id+"\n"), 0o644); err != nil {
		return "", err
	}
	return id, nil
}

// loadOrCreateKey returns the node key in dir, creating it (0600) on first
// use.
func loadOrCreateKey(dir string) (crypto.Signer, error) {
	path := filepath.Join(dir, KeyFile)
	b, err := os.ReadFile(path)
	if err == nil {
		return pki.ParseKeyPEM(b)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	key, err := pki.GenerateKey()
	if err != nil {
		return nil, err
	}
	if err := pki.WriteKey(path, key); err != nil {
		return nil, err
	}
	return key, nil
}

// loadIdentity returns the identity stored in dir, or nil when the machine
// has not joined yet.
func loadIdentity(dir string) (*Identity, error) {
	b, err := os.ReadFile(filepath.Join(dir, NodeFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var id Identity
	if err := json.Unmarshal(b, &id); err != nil {
		return nil, fmt.Errorf("%s: %w", NodeFile, err)
	}
	if id.NodeID == "" || id.GatewayURL == "" {
		return nil, fmt.Errorf("%s: node_id and gateway_url are required", NodeFile)
	}
	kb, err := os.ReadFile(filepath.Join(dir, KeyFile))
	if err != nil {
		return nil, err
	}
	if id.key, err = pki.ParseKeyPEM(kb); err != nil {
		return nil, fmt.Errorf("%s: %w", KeyFile, err)
	}
	if id.cert, err = pki.LoadCert(filepath.Join(dir, CertFile)); err != nil {
		return nil, fmt.Errorf("%s: %w", CertFile, err)
	}
	if id.servingCA, err = pki.LoadCert(filepath.Join(dir, ServingCAFile)); err != nil {
		return nil, fmt.Errorf("%s: %w", ServingCAFile, err)
	}
	return &id, nil
}

// save writes the certificates, then node.json (the commit point).
func (id *Identity) save(dir string, nodeCA *x509.Certificate) error {
	if err := pki.WriteCert(filepath.Join(dir, CertFile), id.cert); err != nil {
		return err
	}
	if nodeCA != nil {
		if err := pki.WriteCert(filepath.Join(dir, NodeCAFile), nodeCA); err != nil {
			return err
		}
	}
	if err := pki.WriteCert(filepath.Join(dir, ServingCAFile), id.servingCA); err != nil {
		return err
	}
	b, err := json.MarshalIndent(id, "", "  ")
	if err != nil {
		return err
	}
	return writeFileSync(filepath.Join(dir, NodeFile), append(b, '\n'), 0o644)
}

// tlsCertificate returns the node's client certificate for mTLS.
func (id *Identity) tlsCertificate() tls.Certificate {
	return tls.Certificate{Certificate: [][]byte{id.cert.Raw}, PrivateKey: id.key, Leaf: id.cert}
}

// nextBoot increments the boot counter in dir and returns the new value (0
// on the first start).
func nextBoot(dir string) (uint64, error) {
	path := filepath.Join(dir, BootFile)
	b, err := os.ReadFile(path)
	var n uint64
	switch {
	case err == nil:
		prev, perr := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if perr != nil {
			return 0, fmt.Errorf("%s: %w", BootFile, perr)
		}
		n = prev + 1
	case errors.Is(err, fs.ErrNotExist):
	default:
		return 0, err
	}
	return n, writeBoot(dir, n)
}

func writeBoot(dir string, n uint64) error {
	return writeFileSync(filepath.Join(dir, BootFile), []byte(strconv.FormatUint(n, 10)+"\n"), 0o644)
}
