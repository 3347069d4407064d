package agent

import (
	"crypto"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
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

// Files of a machine's directory (besides the journal's and the lock).
const (
	// NodeFile is the node's whole identity (JSON, mode 0600): node id,
	// machine id, the key and the certificates as PEM. It is written once,
	// atomically, when the Join completes, so its presence means the machine
	// has joined and a crash never leaves half an identity.
	NodeFile = "node.json"
	// PendingJoinFile holds the key and machine id of a Join that has not
	// completed (JSON, mode 0600), written before the first attempt: a
	// machine stopped mid-join joins again with them, so JoinService
	// answers with the node that key joined as instead of making another.
	// It goes once NodeFile is written.
	PendingJoinFile = "join.pending"
	// BootFile holds the boot counter of the last boot that did not join.
	// Every start of the process is a boot: the start that joins is boot 0
	// and writes nothing more; each later start writes its number here.
	BootFile = "boot"
)

// Identity is what a machine keeps on disk after joining (NodeFile).
type Identity struct {
	// NodeID is the node's id ("node_…").
	NodeID string `json:"node_id"`
	// MachineID is the machine's stable id (Hardware.MachineID when it
	// joined).
	MachineID string `json:"machine_id"`
	// Variant is the hardware variant the machine joined with
	// (Hardware.Variant).
	Variant string `json:"variant"`
	// GatewayURLs are every gateway replica's Session URL
	// (JoinResponse.gateway_urls, at least one); the node starts on one and
	// moves to the next when it loses its session.
	GatewayURLs []string `json:"gateway_urls"`
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
	// KeyPEM is the node's private key (PKCS#8 PEM), made for the Join.
	KeyPEM string `json:"key_pem"`
	// CertificatePEM is the node certificate (PEM).
	CertificatePEM string `json:"certificate_pem"`
	// NodeCAPEM is the node CA certificate of the JoinResponse (PEM; empty
	// when the response had none).
	NodeCAPEM string `json:"node_ca_pem,omitempty"`
	// ServingCAPEM is the CA of gateway serving certificates (PEM), the only
	// root the node trusts for its Session. It matched the servingCa pin at
	// Join.
	ServingCAPEM string `json:"serving_ca_pem"`
	// CommandSigningRoot is the command-signing root of the JoinResponse's
	// trust (DER SubjectPublicKeyInfo of an Ed25519 key; base64 in JSON),
	// empty when the deployment does not sign intent. When set, the node
	// refuses unsigned or wrongly signed commands and specs.
	CommandSigningRoot []byte `json:"command_signing_root,omitempty"`

	key         crypto.Signer
	cert        *x509.Certificate
	servingCA   *x509.Certificate
	commandRoot ed25519.PublicKey
	// pemOf is the key that KeyPEM encodes, when it was encoded or read
	// already (the pending join's, the file's): save encodes key again
	// only when it is another (a renewal's).
	pemOf crypto.Signer
}

// CommandSigningKey returns the command-signing root the node checks intent
// against (parsed CommandSigningRoot), or nil when the deployment does not
// sign intent.
func (id *Identity) CommandSigningKey() ed25519.PublicKey { return id.commandRoot }

// pendingJoin is PendingJoinFile's content.
type pendingJoin struct {
	MachineID string `json:"machine_id"`
	KeyPEM    string `json:"key_pem"`
	key       crypto.Signer
}

// loadPendingJoin returns the pending join in dir, or nil when there is
// none.
func loadPendingJoin(dir string) (*pendingJoin, error) {
	b, err := os.ReadFile(filepath.Join(dir, PendingJoinFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var p pendingJoin
	if err := json.Unmarshal(b, &p); err != nil {
		return nil, fmt.Errorf("%s: %w", PendingJoinFile, err)
	}
	if p.MachineID == "" {
		return nil, fmt.Errorf("%s: machine_id is required", PendingJoinFile)
	}
	if p.key, err = pki.ParseKeyPEM([]byte(p.KeyPEM)); err != nil {
		return nil, fmt.Errorf("%s: key_pem: %w", PendingJoinFile, err)
	}
	return &p, nil
}

// savePendingJoin writes the pending join of a machine with machineID and
// key to dir, durably, before its first Join attempt, and returns it.
func savePendingJoin(dir, machineID string, key crypto.Signer) (*pendingJoin, error) {
	pem, err := pki.EncodeKeyPEM(key)
	if err != nil {
		return nil, err
	}
	p := &pendingJoin{MachineID: machineID, KeyPEM: string(pem), key: key}
	b, err := json.Marshal(p)
	if err != nil {
		return nil, err
	}
	return p, writeFileSync(filepath.Join(dir, PendingJoinFile), append(b, '\n'), 0o600)
}

// ReadIdentity returns the identity a machine directory dir (a Runner's
// DataDir/<index>) holds, or nil when the machine has not joined; an
// unreadable or corrupt NodeFile is an error.
func ReadIdentity(dir string) (*Identity, error) { return loadIdentity(dir) }

// Joined reports whether the machine directory dir (a Runner's
// DataDir/<index>) holds a node identity, i.e. the machine will restart
// without joining again. A directory that is missing or has no NodeFile
// has not joined; an unreadable or corrupt NodeFile is an error.
func Joined(dir string) (bool, error) {
	id, err := loadIdentity(dir)
	return id != nil, err
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
	if id.NodeID == "" || id.MachineID == "" || len(id.GatewayURLs) == 0 {
		return nil, fmt.Errorf("%s: node_id, machine_id and gateway_urls are required", NodeFile)
	}
	if id.key, err = pki.ParseKeyPEM([]byte(id.KeyPEM)); err != nil {
		return nil, fmt.Errorf("%s: key_pem: %w", NodeFile, err)
	}
	id.pemOf = id.key
	if id.cert, err = pki.ParseCertPEM([]byte(id.CertificatePEM)); err != nil {
		return nil, fmt.Errorf("%s: certificate_pem: %w", NodeFile, err)
	}
	if id.servingCA, err = pki.ParseCertPEM([]byte(id.ServingCAPEM)); err != nil {
		return nil, fmt.Errorf("%s: serving_ca_pem: %w", NodeFile, err)
	}
	if len(id.CommandSigningRoot) > 0 {
		if id.commandRoot, err = pki.ParseEd25519SPKI(id.CommandSigningRoot); err != nil {
			return nil, fmt.Errorf("%s: command_signing_root: %w", NodeFile, err)
		}
	}
	return &id, nil
}

// save fills the PEM fields from the key and certificates and writes
// NodeFile atomically and durably (the commit point of the Join). The key
// is encoded unless KeyPEM holds it already (pemOf): a join's key was
// encoded for its pending join.
func (id *Identity) save(dir string, nodeCA *x509.Certificate) error {
	if id.pemOf != id.key {
		key, err := pki.EncodeKeyPEM(id.key)
		if err != nil {
			return err
		}
		id.KeyPEM, id.pemOf = string(key), id.key
	}
	id.CertificatePEM = string(pki.EncodeCertPEM(id.cert))
	id.ServingCAPEM = string(pki.EncodeCertPEM(id.servingCA))
	if nodeCA != nil {
		id.NodeCAPEM = string(pki.EncodeCertPEM(nodeCA))
	}
	b, err := json.MarshalIndent(id, "", "  ")
	if err != nil {
		return err
	}
	return writeFileSync(filepath.Join(dir, NodeFile), append(b, '\n'), 0o600)
}

// tlsCertificate returns the node's client certificate for mTLS.
func (id *Identity) tlsCertificate() tls.Certificate {
	return tls.Certificate{Certificate: [][]byte{id.cert.Raw}, PrivateKey: id.key, Leaf: id.cert}
}

// nextBoot returns the number of this start of a joined machine and
// records it in dir: one more than BootFile says, or 1 when BootFile does
// not exist (the start that joined was boot 0 and wrote no counter).
func nextBoot(dir string) (uint64, error) {
	b, err := os.ReadFile(filepath.Join(dir, BootFile))
	var n uint64 = 1
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

// writeBoot records boot n durably, so that no later start reuses its id.
func writeBoot(dir string, n uint64) error {
	return writeFileSync(filepath.Join(dir, BootFile), []byte(strconv.FormatUint(n, 10)+"\n"), 0o600)
}
