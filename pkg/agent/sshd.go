package agent

// The machine's SSH server (docs/architecture.md, "Tunnels"): one per
// machine, reachable only through ssh tunnels (it listens on no port), with
// golang.org/x/crypto/ssh. A login is accepted only with a user certificate
// that sshca.Authorize accepts against the node's current applied NodeSpec
// (its SSH user CAs and its reservations, daemon.SSHAccess); there is no
// password or keyboard-interactive authentication. Every refusal is logged
// and handed to the machine's loop, which reports it on the session
// (Report.ssh_refused). A connection whose login stops being allowed by a
// later spec (its CA dropped, or for a sandbox login its reservation) is
// closed. Sessions offer the machine's shell (Hardware.Shell): pty-req,
// window-change, shell and exec (one line, then its exit-status); env is
// refused and ignored; no port forwarding, no subsystems, no agent or X11
// forwarding.

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/ssh"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// HostKeyFile is the machine's SSH host key in its data directory: an
// ed25519 key in OpenSSH's private key format, 0600, made at the first ssh
// tunnel and kept for every later one, across restarts.
const HostKeyFile = "ssh_host_ed25519_key"

// sshHandshakeTimeout is how long an ssh tunnel may take to authenticate
// before it is closed.
const sshHandshakeTimeout = 30 * time.Second

// sshServerVersion is the version the server announces.
const sshServerVersion = "SSH-2.0-better-compute"

// Permissions extensions the server records an accepted login in.
const (
	permCA    = "better-compute-ca"     // the CA's name (sshca.BreakGlass, sshca.Sandbox)
	permCAKey = "better-compute-ca-key" // the CA's public key, wire format
	permKeyID = "better-compute-key-id" // the certificate's key id
)

// sshServer is one machine's SSH server. Safe for concurrent use: every
// tunnel serves its connection on its own goroutine.
type sshServer struct {
	log    *slog.Logger
	dir    string // the machine's data directory (HostKeyFile)
	nodeID string
	clk    clock.Clock
	hw     Hardware
	// refused hands a refused login to the machine's loop (it never
	// blocks).
	refused func(*gatewayv1.SshRefused)
	access  atomic.Pointer[daemon.SSHAccess]

	keyMu  sync.Mutex
	signer ssh.Signer // the host key, once loaded

	mu     sync.Mutex
	logins map[*sshLogin]struct{} // the authenticated connections
}

// sshLogin is an authenticated connection: who, by which CA, and how to
// close it.
type sshLogin struct {
	user, ca, keyID string
	caKey           string // wire format
	cancel          context.CancelFunc
}

func newSSHServer(log *slog.Logger, dir, nodeID string, clk clock.Clock, hw Hardware, access *daemon.SSHAccess,
	refused func(*gatewayv1.SshRefused)) *sshServer {
	s := &sshServer{log: log, dir: dir, nodeID: nodeID, clk: clk, hw: hw, refused: refused, logins: map[*sshLogin]struct{}{}}
	s.access.Store(access)
	return s
}

// setAccess makes acc what logins are checked against and closes the
// connections it no longer allows. It never blocks on a connection.
func (s *sshServer) setAccess(acc *daemon.SSHAccess) {
	s.access.Store(acc)
	s.mu.Lock()
	defer s.mu.Unlock()
	for l := range s.logins {
		if why := stillAllowed(acc, l); why != "" {
			s.log.Info("closing an SSH connection the node's spec no longer allows", "user", l.user, "ca", l.ca,
				"key_id", l.keyID, "reason", why)
			l.cancel()
		}
	}
}

// stillAllowed returns why the login l is no longer allowed by acc, or ""
// when it is: its CA still trusted and, for a sandbox login, its
// reservation still in the spec. (Certificates are checked for expiry at
// login only, as OpenSSH does.)
func stillAllowed(acc *daemon.SSHAccess, l *sshLogin) string {
	trusted := false
	for _, a := range acc.Authorities {
		if a.Name == l.ca && string(a.Key.Marshal()) == l.caKey {
			trusted = true
		}
	}
	switch {
	case !trusted:
		return "the node no longer trusts the certificate's CA"
	case l.ca == sshca.Sandbox && !acc.HasReservation(l.user):
		return "reservation " + l.user + " is no longer on this node"
	}
	return ""
}

// hostKey returns the host key, reading HostKeyFile or, on first use,
// making it. A key file that does not parse is an error (never replaced:
// a changed host key is what clients warn about).
func (s *sshServer) hostKey() (ssh.Signer, error) {
	s.keyMu.Lock()
	defer s.keyMu.Unlock()
	if s.signer != nil {
		return s.signer, nil
	}
	path := filepath.Join(s.dir, HostKeyFile)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		signer, err := ssh.ParsePrivateKey(b)
		if err != nil {
			return nil, fmt.Errorf("ssh host key %s: %w", path, err)
		}
		s.signer = signer
	case errors.Is(err, fs.ErrNotExist):
		_, key, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return nil, err
		}
		block, err := ssh.MarshalPrivateKey(key, "")
		if err != nil {
			return nil, err
		}
		if err := writeFileSync(path, pem.EncodeToMemory(block), 0o600); err != nil {
			return nil, fmt.Errorf("ssh host key: %w", err)
		}
		if s.signer, err = ssh.NewSignerFromKey(key); err != nil {
			return nil, err
		}
		s.log.Info("made the machine's SSH host key", "path", path,
			"fingerprint", ssh.FingerprintSHA256(s.signer.PublicKey()))
	default:
		return nil, fmt.Errorf("ssh host key: %w", err)
	}
	return s.signer, nil
}

// config returns the server configuration: the host key and certificate
// logins only.
func (s *sshServer) config() (*ssh.ServerConfig, error) {
	key, err := s.hostKey()
	if err != nil {
		return nil, err
	}
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: s.authorize,
		ServerVersion:     sshServerVersion,
	}
	cfg.AddHostKey(key)
	return cfg, nil
}

// authorize is the PublicKeyCallback: sshca.Authorize against the node's
// current access. A refusal is logged and reported.
func (s *sshServer) authorize(meta ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
	acc := s.access.Load()
	ca, err := sshca.Authorize(sshca.Login{
		User:         meta.User(),
		Key:          key,
		NodeID:       s.nodeID,
		Authorities:  acc.Authorities,
		Reservations: acc.HasReservation,
		Now:          s.clk.Now(),
	})
	if err != nil {
		r := &gatewayv1.SshRefused{Reason: err.Error(), User: meta.User()}
		var refusal *sshca.Refusal
		if errors.As(err, &refusal) {
			r.Reason, r.KeyId = refusal.Reason, refusal.KeyID
		}
		s.log.Warn("SSH login refused", "user", r.GetUser(), "key_id", r.GetKeyId(), "reason", r.GetReason())
		s.refused(r)
		return nil, err
	}
	cert := key.(*ssh.Certificate) // Authorize accepts certificates only
	return &ssh.Permissions{Extensions: map[string]string{
		permCA: ca, permCAKey: string(cert.SignatureKey.Marshal()), permKeyID: cert.KeyId,
	}}, nil
}

// serve serves one SSH connection over c until it ends; cancel ends the
// tunnel (c's stream), and with it the connection. It returns why the
// connection could not be set up, if it could not.
func (s *sshServer) serve(ctx context.Context, cancel context.CancelFunc, c net.Conn, log *slog.Logger) error {
	cfg, err := s.config()
	if err != nil {
		log.Error("the SSH server cannot start", telemetry.KeyError, err)
		return err
	}
	// The handshake reads the tunnel, which has no deadlines: a client
	// that does not log in within sshHandshakeTimeout loses the tunnel.
	handshook := make(chan struct{})
	timeout := s.clk.NewTimer(sshHandshakeTimeout)
	var timers sync.WaitGroup
	timers.Go(func() {
		defer timeout.Stop()
		select {
		case <-timeout.C():
			log.Info("SSH handshake timed out", "after", sshHandshakeTimeout.String())
			cancel()
		case <-handshook:
		case <-ctx.Done():
		}
	})
	sc, chans, reqs, err := ssh.NewServerConn(c, cfg)
	close(handshook)
	timers.Wait()
	if err != nil {
		log.Info("SSH connection not set up", telemetry.KeyError, err)
		return err
	}
	defer sc.Close()
	l := &sshLogin{user: sc.User(), ca: sc.Permissions.Extensions[permCA], caKey: sc.Permissions.Extensions[permCAKey],
		keyID: sc.Permissions.Extensions[permKeyID], cancel: cancel}
	log = log.With("user", l.user, "ca", l.ca, "key_id", l.keyID)
	log.Info("SSH login accepted")
	s.mu.Lock()
	s.logins[l] = struct{}{}
	s.mu.Unlock()
	// The spec may have changed between Authorize and here.
	if why := stillAllowed(s.access.Load(), l); why != "" {
		log.Info("closing an SSH connection the node's spec no longer allows", "reason", why)
		cancel()
	}
	defer func() {
		s.mu.Lock()
		delete(s.logins, l)
		s.mu.Unlock()
	}()

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { ssh.DiscardRequests(reqs) }) // tcpip-forward and the like: refused
	for nc := range chans {
		if nc.ChannelType() != "session" {
			_ = nc.Reject(ssh.Prohibited, "only sessions: no port forwarding")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			continue
		}
		wg.Go(func() { s.session(ctx, ch, creqs, &wg, log) })
	}
	// chans is closed: the connection ended.
	return nil
}

// ptyRequest is the payload of "pty-req" (RFC 4254 6.2).
type ptyRequest struct {
	Term                 string
	Cols, Rows, Wpx, Hpx uint32
	Modes                string
}

// windowChange is the payload of "window-change" (RFC 4254 6.7).
type windowChange struct {
	Cols, Rows, Wpx, Hpx uint32
}

// termSize returns a pty's size, each side within 1..10000 (the bounds of
// bc.tunnel.v1.TerminalSize).
func termSize(rows, cols uint32) tunnel.Size {
	clamp := func(v uint32) int { return int(min(max(v, 1), 10000)) }
	return tunnel.Size{Rows: clamp(rows), Cols: clamp(cols)}
}

// session serves one session channel: a pty and its resizes, then one
// shell or exec, whose status goes as exit-status before the channel
// closes. wg counts the goroutines it leaves behind.
func (s *sshServer) session(ctx context.Context, ch ssh.Channel, reqs <-chan *ssh.Request, wg *sync.WaitGroup, log *slog.Logger) {
	defer ch.Close()
	term := tunnel.NewTerm(ch, ch, tunnel.Size{})
	var done chan int // the shell's status, once one was started
	for {
		select {
		case req, open := <-reqs:
			if !open { // the channel closed: the shell's input ends
				_ = ch.Close()
				if done != nil {
					<-done
				}
				return
			}
			ok := false
			switch req.Type {
			case "pty-req":
				var p ptyRequest
				if ssh.Unmarshal(req.Payload, &p) == nil && done == nil {
					term.Resize(termSize(p.Rows, p.Cols))
					ok = true
				}
			case "window-change":
				var w windowChange
				if ssh.Unmarshal(req.Payload, &w) == nil && term.Size() != (tunnel.Size{}) {
					term.Resize(termSize(w.Rows, w.Cols))
					ok = true
				}
			case "shell", "exec":
				command := ""
				if req.Type == "exec" {
					var e struct{ Command string }
					if ssh.Unmarshal(req.Payload, &e) != nil || e.Command == "" {
						break
					}
					command = e.Command
				}
				if done != nil {
					break // one shell or command per session
				}
				ok = true
				done = make(chan int, 1)
				log.Info("SSH session", "request", req.Type, "command", command)
				go func() { done <- s.hw.Shell(ctx, term, command) }()
			}
			// env, subsystem, x11-req, auth-agent-req@openssh.com, signal…:
			// refused.
			if req.WantReply {
				_ = req.Reply(ok, nil)
			}
		case status := <-done:
			_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{uint32(status & 0xff)}))
			_ = ch.CloseWrite()
			// Requests keep coming until the client closes its side.
			wg.Go(func() { ssh.DiscardRequests(reqs) })
			return
		}
	}
}

// refused hands a login the SSH server refused to the loop, which reports
// it (daemon.Agent.ReportSSHRefused); it never blocks: while the loop is
// behind by more than the channel holds, refusals are only logged.
func (d *driver) refused(r *gatewayv1.SshRefused) {
	select {
	case d.refusals <- r:
	default:
		d.log.Warn("SSH refusal not reported: too many at once", "user", r.GetUser(), "reason", r.GetReason())
	}
}
