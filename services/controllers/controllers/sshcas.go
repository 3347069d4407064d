package controllers

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/crypto/ssh"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/store"
)

// LeaseSSHCAs is the SSH CA reconciler's lease.
const LeaseSSHCAs = LeasePrefix + "ssh-cas"

// DefaultSSHCAInterval is how often the SSH CA reconciler reads the PKI
// directory when SSHCAs.Interval is zero.
const DefaultSSHCAInterval = time.Minute

// SSHCAs keeps the SSH user CAs every NodeSpec carries (store.SSHUserCAs)
// equal to the PKI directory's public keys (pkg/pki SSHBreakGlassCAPub,
// SSHSandboxCAPub): at start and every Interval, so that a rotation of the
// files reaches every node as a new spec generation (docs/architecture.md,
// "Tunnels"). A PKI directory without the CA files (one made before them:
// `better-compute pki init` adds them) changes nothing and says so once.
type SSHCAs struct {
	DB     *store.DB
	Logger *slog.Logger
	Clock  clock.Clock
	// PKIDir holds the CAs' public files.
	PKIDir string
	// Intent signs the specs a rotation changes; nil: unsigned.
	Intent *store.IntentSigner
	// Interval is how often the directory is read; DefaultSSHCAInterval if
	// zero.
	Interval time.Duration

	warned bool
}

// Name returns "ssh-cas" (service.Runner); its lease is LeasePrefix +
// "ssh-cas".
func (c *SSHCAs) Name() string { return "ssh-cas" }

// Run reconciles at start and every Interval until ctx ends.
func (c *SSHCAs) Run(ctx context.Context) error {
	return every(ctx, clockOf(c.Clock, c.DB), positive(c.Interval, DefaultSSHCAInterval), c.Logger, "ssh-cas", c.Reconcile)
}

// Reconcile sets the CAs from the PKI directory and reports whether that
// changed them. Errors: a CA file that does not parse, the database's.
func (c *SSHCAs) Reconcile(ctx context.Context) (bool, error) {
	cas, err := ReadSSHUserCAs(c.PKIDir)
	if errors.Is(err, fs.ErrNotExist) {
		if !c.warned {
			logger(c.Logger).Warn("no SSH user CAs in the PKI directory: nodes keep the CAs they have (run `better-compute pki init` to add them)",
				"dir", c.PKIDir, "err", err)
			c.warned = true
		}
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var changed bool
	err = c.DB.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		changed, err = store.SetSSHUserCAs(ctx, tx, c.Intent, clockOf(c.Clock, c.DB).Now(), cas)
		return err
	})
	if err != nil {
		return false, err
	}
	if changed {
		logger(c.Logger).Info("SSH user CAs changed: every adopted node gets a new spec generation")
	}
	return changed, nil
}

// ReadSSHUserCAs reads the break-glass and sandbox CAs' public keys from
// the PKI directory dir, as a NodeSpec carries them. Errors: a missing file
// (fs.ErrNotExist), one that is not an Ed25519 public key.
func ReadSSHUserCAs(dir string) ([]*gatewayv1.SshUserCa, error) {
	var out []*gatewayv1.SshUserCa
	for _, ca := range []struct{ name, file string }{
		{sshca.BreakGlass, pki.SSHBreakGlassCAPub},
		{sshca.Sandbox, pki.SSHSandboxCAPub},
	} {
		path := filepath.Join(dir, ca.file)
		pub, _, err := pki.LoadPublicKey(path)
		if err != nil {
			return nil, err
		}
		ed, ok := pub.(ed25519.PublicKey)
		if !ok {
			return nil, fmt.Errorf("%s: not an Ed25519 public key", path)
		}
		k, err := ssh.NewPublicKey(ed)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, &gatewayv1.SshUserCa{Name: ca.name, PublicKey: sshca.MarshalPublicKey(k)})
	}
	return out, nil
}
