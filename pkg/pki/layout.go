package pki

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
)

// The control-plane services whose files a PKI directory holds (Layout).
const (
	ServiceAPI         = "api"
	ServiceJoinService = "joinservice"
	ServiceGateway     = "gateway"
	ServiceScheduler   = "scheduler"
	ServiceControllers = "controllers"
)

// layout is which files of a PKI directory each service reads, and why: the
// one place that says so (docs/architecture.md, "Keys and roles"). A service
// given only its files (Export) starts; one missing any of them fails at
// start with an error naming the file (the gateway's tunnel-ticket.pub and
// the controllers' SSH CA public keys excepted: without them the gateway
// refuses every tunnel and the controllers leave the nodes' SSH CAs as they
// are, each saying so in its log).
//
// No service reads serving-ca.key (only Init, which issues the gateway's and
// JoinService's certificates with it) or pins.json (daemons get the pins out
// of band), and only JoinService reads node-ca.key: it signs every node
// certificate, at join and the renewals gateways ask it for
// (NodeCertService), so that a gateway cannot mint node identities.
var layout = map[string][]string{
	ServiceAPI: {
		// The well-known document: the pins and the public keys machines
		// join with, and the serving CA, which is also the root the API
		// verifies https:// gateway control URLs with.
		ServingCACert, JoinEncryptionPub, JoinSigningPub, CommandSigningPub,
		// Signed intent: the NodeSpecs a release changes.
		CommandSigningKey,
		// Tunnels: exec tickets, and the SSH certificates of break-glass and
		// sandbox logins.
		TunnelTicketKey, SSHBreakGlassCAKey, SSHSandboxCAKey,
	},
	ServiceJoinService: {
		// Node certificates at join and at renewal (node CA), and the
		// JoinResponse's serving CA, trust domain and command-signing root.
		TrustDomainTxt, NodeCACert, NodeCAKey, ServingCACert, CommandSigningPub,
		// Opens sealed join tokens; signs JoinResponses.
		JoinEncryptionKey, JoinSigningKey,
		// The mutual-TLS control listener (NodeCertService), whose clients
		// are the gateways: its certificate; the serving CA verifies theirs.
		JoinServiceCert, JoinServiceKey,
	},
	ServiceGateway: {
		// The mutual-TLS server: its certificate, the node CA that client
		// certificates chain to, and their trust domain. Its certificate is
		// also its client certificate toward JoinService, which signs the
		// certificates daemons renew over their sessions (RenewCertificate),
		// and which it verifies with the serving CA.
		TrustDomainTxt, GatewayCert, GatewayKey, NodeCACert, ServingCACert,
		// Verifies exec tickets.
		TunnelTicketPub,
	},
	ServiceScheduler: {
		// Signed intent: the NodeSpecs placements change.
		CommandSigningKey,
	},
	ServiceControllers: {
		// Signed intent: acceptance commands and the NodeSpecs adoption,
		// expiry and CA rotations change.
		CommandSigningKey,
		// The SSH user CAs every NodeSpec carries.
		SSHBreakGlassCAPub, SSHSandboxCAPub,
	},
}

// Services returns the names of the services of Layout, sorted.
func Services() []string {
	names := make([]string, 0, len(layout))
	for n := range layout {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Layout returns the names of the files of a PKI directory that service
// reads, sorted; an error names the services when service is none of them.
func Layout(service string) ([]string, error) {
	files, ok := layout[service]
	if !ok {
		return nil, fmt.Errorf("unknown service %q: want one of %v", service, Services())
	}
	out := slices.Clone(files)
	sort.Strings(out)
	return out, nil
}

// Files returns the names of every file Init writes, sorted.
func Files() []string {
	out := []string{TrustDomainTxt, NodeCACert, ServingCACert, GatewayCert, JoinServiceCert, PinsJSON}
	out = append(out, privateKeyFiles...)
	out = append(out, JoinEncryptionPub, JoinSigningPub, CommandSigningPub, TunnelTicketPub, SSHBreakGlassCAPub, SSHSandboxCAPub)
	sort.Strings(out)
	return out
}

// IsPrivateKey reports whether name is the name of a private key file.
func IsPrivateKey(name string) bool { return slices.Contains(privateKeyFiles, name) }

// ExportResult is what Export did, file names relative to its out directory.
type ExportResult struct {
	// Wrote are the files written: missing in out, or different there.
	Wrote []string
	// Removed are the files of a PKI directory (Files) that were in out
	// but are not the service's.
	Removed []string
}

// Export copies the files of PKI directory dir that service reads (Layout)
// into out, made (0700) when missing, so that out can be that service's
// PKI_DIR and hold nothing else of the deployment: a file of a PKI
// directory in out that is not the service's is removed, other files are
// left alone. Private keys are written 0600, other files 0644, each
// atomically and only when it differs. A file missing from dir is an error
// naming it and the service, before anything is written.
func Export(dir, service, out string) (ExportResult, error) {
	var res ExportResult
	files, err := Layout(service)
	if err != nil {
		return res, err
	}
	contents := make(map[string][]byte, len(files))
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return res, fmt.Errorf("%s reads %s: %w", service, f, err)
		}
		contents[f] = b
	}
	if err := os.MkdirAll(out, 0o700); err != nil {
		return res, err
	}
	for _, f := range files {
		mode := os.FileMode(0o644)
		if IsPrivateKey(f) {
			mode = 0o600
		}
		path := filepath.Join(out, f)
		if old, err := os.ReadFile(path); err == nil && string(old) == string(contents[f]) {
			if st, err := os.Stat(path); err == nil && st.Mode().Perm() == mode {
				continue
			}
		}
		if err := writeFileAtomic(path, contents[f], mode); err != nil {
			return res, err
		}
		res.Wrote = append(res.Wrote, f)
	}
	for _, f := range Files() {
		if slices.Contains(files, f) {
			continue
		}
		err := os.Remove(filepath.Join(out, f))
		switch {
		case err == nil:
			res.Removed = append(res.Removed, f)
		case !errors.Is(err, fs.ErrNotExist):
			return res, err
		}
	}
	return res, nil
}
