package agent

import (
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Machine is the handle of one machine of a Runner. Its methods are safe for
// concurrent use.
type Machine struct {
	r     *Runner
	index int
	dir   string
	log   *slog.Logger

	mu sync.Mutex
	st MachineStatus

	cert clientCert // the node certificate presented at each TLS handshake

	// refusal is the refused Join of a JoinOnly run (set by the Runner).
	refusal *JoinRefusedError
}

// MachineStatus is a snapshot of a machine.
type MachineStatus struct {
	// Index is the machine's index in the Runner (its directory name).
	Index int
	// MachineID is the machine's stable id ("" before it was read).
	MachineID string
	// NodeID is the node id ("" until the machine has joined).
	NodeID string
	// Variant is the machine's hardware variant (Hardware.Variant; "" before
	// its Hardware was made).
	Variant string
	// Joined reports that the machine has a node identity.
	Joined bool
	// State is the daemon core's session state.
	State daemon.State
	// SessionID is the gateway's session id while established.
	SessionID string
	// GatewayID is the id of the gateway holding the session while
	// established (Welcome.gateway_id), else "".
	GatewayID string
	// Silenced counts the sessions the machine dropped because their
	// gateway stopped answering (daemon.Config.SilenceTimeout).
	Silenced int
	// BootID is the machine's current boot id.
	BootID string
	// ObservedGeneration is the NodeSpec generation applied.
	ObservedGeneration int64
	// Sessions counts the sessions that reached Welcome.
	Sessions int
	// CertNotAfter is when the node certificate in use expires.
	CertNotAfter time.Time
	// Renewals counts the certificates renewed over the session and stored
	// since the machine started.
	Renewals int
	// Tunnels is how many tunnels the machine serves now (shell and ssh).
	Tunnels int
	// Runs counts the commands the Hardware ran (not those answered from
	// the journal) since the machine started: a command delivered twice
	// and run once counts one.
	Runs int
	// Stopped is why the machine stopped for good ("" while it runs): its
	// node was revoked or its certificate expired (daemon.StateStopped), and
	// it must join again. The Runner reports unhealthy while any machine is
	// stopped.
	Stopped string
	// JoinError is why the machine could not join with Config.JoinOnly
	// (e.g. "join refused: join token is used up (2 of 2 uses)"), "" if it
	// joined.
	JoinError string
}

// Index returns the machine's index.
func (m *Machine) Index() int { return m.index }

// Dir returns the machine's data directory.
func (m *Machine) Dir() string { return m.dir }

// Status returns a snapshot of the machine.
func (m *Machine) Status() MachineStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.st
}

// NodeID returns the node id, "" until the machine has joined.
func (m *Machine) NodeID() string { return m.Status().NodeID }

// State returns the session state.
func (m *Machine) State() daemon.State { return m.Status().State }

func (m *Machine) update(f func(*MachineStatus)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f(&m.st)
}

// JoinRefusedError is a Join that JoinService refused for good (bad, expired,
// revoked or used-up token, malformed request). Its message is the server's.
type JoinRefusedError struct {
	// Code is the Connect code of the refusal.
	Code connect.Code
	// Message is the server's message, e.g. "join token is used up (10 of 10
	// uses)".
	Message string
}

// Error returns "join refused: <server message>".
func (e *JoinRefusedError) Error() string { return "join refused: " + e.Message }

// permanent reports whether a Join error will not go away by retrying.
func permanent(code connect.Code) bool {
	switch code {
	case connect.CodePermissionDenied, connect.CodeFailedPrecondition, connect.CodeInvalidArgument,
		connect.CodeUnauthenticated, connect.CodeNotFound, connect.CodeAlreadyExists,
		connect.CodeUnimplemented, connect.CodeOutOfRange:
		return true
	}
	return false
}

// run joins if needed and drives the daemon core until ctx ends.
func (m *Machine) run(ctx context.Context) error {
	if err := os.MkdirAll(m.dir, 0o700); err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	unlock, err := lockDir(m.dir)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	defer unlock()
	id, err := loadIdentity(m.dir)
	if err != nil {
		return fmt.Errorf("machine %d: identity: %w", m.index, err)
	}
	pending, err := loadPendingJoin(m.dir)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	spec := HardwareSpec{Index: m.index, Logger: m.log}
	switch {
	case id != nil:
		spec.MachineID, spec.Variant = id.MachineID, id.Variant
	case pending != nil:
		spec.MachineID = pending.MachineID // stopped mid-join: the same machine
	}
	// The start that joins is boot 0 and writes nothing but the identity;
	// every later start advances the boot counter on disk.
	if id != nil && !m.r.cfg.JoinOnly { // joining only is no boot of the machine
		if spec.Boot, err = nextBoot(m.dir); err != nil {
			return fmt.Errorf("machine %d: %w", m.index, err)
		}
	}
	hw, err := m.r.hardware(spec)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	m.update(func(s *MachineStatus) { s.MachineID, s.Variant = hw.MachineID(), hw.Variant() })
	if id == nil {
		if id, err = m.join(ctx, hw, pending); err != nil {
			return err
		}
	}
	log := m.log.With(telemetry.KeyNodeID, id.NodeID)
	m.update(func(s *MachineStatus) {
		s.NodeID, s.Joined, s.BootID, s.CertNotAfter = id.NodeID, true, hw.BootID(), id.cert.NotAfter
	})

	if m.r.cfg.JoinOnly {
		return nil
	}

	j, err := openFileJournal(m.dir, m.r.clk.Now(), true)
	if err != nil {
		return fmt.Errorf("machine %d: journal: %w", m.index, err)
	}
	defer j.Close()
	if !j.LostAt().IsZero() {
		log.Warn("journal was lost; commands that may have run before are failed unless retry-safe", "lost_at", j.LostAt(), "epoch", j.Epoch())
	}

	gwURLs, tlsCfg, err := m.gatewayTLS(id)
	if err != nil {
		return fmt.Errorf("machine %d: %w", m.index, err)
	}
	conns := newConnTracker()
	tr := newTransport(tlsCfg, conns)
	defer tr.CloseIdleConnections()

	acfg := m.r.cfg.Core
	acfg.NodeID = id.NodeID
	acfg.AgentVersion = m.r.cfg.AgentVersion
	acfg.Logger = log
	acfg.CertNotBefore, acfg.CertNotAfter = id.cert.NotBefore, id.cert.NotAfter
	// The joined certificate arrived at JoinedAt; a renewed one has a later
	// NotBefore, which then wins (daemon.Config.CertReceivedAt).
	acfg.CertReceivedAt = id.JoinedAt
	acfg.CommandSigningRoot = id.CommandSigningKey()
	seed := sha256.Sum256([]byte(hw.MachineID()))
	core, err := daemon.New(acfg, countingHardware{hw, m}, j, rand.New(rand.NewPCG(binary.BigEndian.Uint64(seed[:8]), spec.Boot)))
	if err != nil {
		return err
	}
	d := &driver{m: m, log: log, clk: m.r.clk, core: core, hw: hw, boot: spec.Boot, dir: m.dir,
		events: make(chan event, 16), timer: m.r.clk.NewTimer(time.Hour),
		urls: gwURLs, gw: int(binary.BigEndian.Uint64(seed[8:16]) % uint64(len(gwURLs))),
		conns: conns, rn: renewState{id: id, tlsCfg: tlsCfg, tr: tr},
		refusals: make(chan *gatewayv1.SshRefused, daemon.MaxPendingSSHRefusals),
		nodeID:   id.NodeID, spans: commandSpans{}}
	d.sshd = newSSHServer(log.With("part", "sshd"), m.dir, id.NodeID, m.r.clk, hw, core.SSHAccess(), d.refused)
	d.makeClients()
	d.framed = make([]bool, len(gwURLs))
	for i := range d.framed {
		d.framed[i] = m.r.cfg.SessionTransport == SessionFramed
	}
	d.timer.Stop()
	log.Info("machine up", "variant", hw.Variant(), "boot", spec.Boot, "gateways", gwURLs)
	return d.loop(ctx)
}

// join makes the node's identity with JoinService, retrying transient
// errors: the token goes sealed to JoinService's key and bound to the CSR,
// and nothing of the response is used before pki.CheckJoinResponse accepted
// it against the pins.
func (m *Machine) join(ctx context.Context, hw Hardware, pending *pendingJoin) (*Identity, error) {
	trust, err := m.r.joinTrust(ctx)
	if err != nil {
		return nil, err
	}
	// The key is kept (PendingJoinFile) before the first attempt: a machine
	// stopped before the answer came joins again with it, and JoinService
	// answers with the node that key joined as, if the first attempt got
	// that far, rather than making another.
	if pending == nil {
		key, err := pki.GenerateKey()
		if err != nil {
			return nil, fmt.Errorf("machine %d: key: %w", m.index, err)
		}
		if pending, err = savePendingJoin(m.dir, hw.MachineID(), key); err != nil {
			return nil, fmt.Errorf("machine %d: %w", m.index, err)
		}
	}
	key := pending.key
	csr, err := pki.NewCSR(key, hw.Hostname())
	if err != nil {
		return nil, err
	}
	token, err := m.r.readToken(ctx)
	if err != nil {
		return nil, err
	}
	sealed, err := pki.SealJoinToken(trust.keys.Encryption, token, csr)
	if err != nil {
		return nil, fmt.Errorf("machine %d: seal the join token: %w", m.index, err)
	}
	req := &joinv1.JoinRequest{
		SealedToken: sealed,
		CsrDer:      csr,
		Claims: &joinv1.Claims{
			Hostname:     hw.Hostname(),
			MachineId:    hw.MachineID(),
			AgentVersion: m.r.cfg.AgentVersion,
			Variant:      hw.Variant(),
		},
	}
	// Claims the hardware reports outside join.proto's rules (a hostname
	// that is none, a control character) are fitted rather than refused.
	if fitted, err := daemon.Conform(req); err != nil {
		m.log.Warn("join claims fitted to JoinService's rules", telemetry.KeyError, err)
		req = fitted
	}
	var resp *connect.Response[joinv1.JoinResponse]
	for attempt := 1; ; attempt++ {
		select {
		case m.r.joinSem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		resp, err = trust.client.Join(ctx, connect.NewRequest(req))
		<-m.r.joinSem
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var cerr *connect.Error
		if errors.As(err, &cerr) && permanent(cerr.Code()) {
			return nil, &JoinRefusedError{Code: cerr.Code(), Message: cerr.Message()}
		}
		delay := daemon.BackoffCap(m.r.cfg.JoinBackoffMin, m.r.cfg.JoinBackoffMax, attempt)
		delay = delay/2 + time.Duration(rand.Int64N(int64(delay/2)+1))
		m.log.Warn("join failed; retrying", "attempt", attempt, "in", delay.String(), telemetry.KeyError, err)
		if err := clock.Sleep(ctx, m.r.clk, delay); err != nil {
			return nil, err
		}
	}
	id, nodeCA, err := checkJoinResponse(resp.Msg, trust.pins, trust.keys.SigningSPKI, key.Public())
	if err != nil {
		return nil, fmt.Errorf("machine %d: %w", m.index, err)
	}
	id.MachineID, id.Variant, id.JoinedAt, id.key = hw.MachineID(), hw.Variant(), m.r.clk.Now().UTC(), key
	id.KeyPEM, id.pemOf = pending.KeyPEM, key
	// The journal comes first: once the identity is saved, a missing
	// journal is a loss.
	if err := initFileJournal(m.dir); err != nil {
		return nil, fmt.Errorf("machine %d: journal: %w", m.index, err)
	}
	if err := id.save(m.dir, nodeCA); err != nil {
		return nil, fmt.Errorf("machine %d: save identity: %w", m.index, err)
	}
	if err := os.Remove(filepath.Join(m.dir, PendingJoinFile)); err != nil {
		return nil, fmt.Errorf("machine %d: %w", m.index, err)
	}
	m.log.Info("joined", telemetry.KeyNodeID, id.NodeID, telemetry.KeyPoolID, id.PoolID,
		"signed_intent", id.commandRoot != nil)
	return id, nil
}

// checkJoinResponse is what a machine checks of JoinService's answer msg
// before it uses any of it: pki.CheckJoinResponse against pins and the join
// signing key signingSPKI (a DER SubjectPublicKeyInfo), then that the
// certificate is for the machine's key pub and that msg names a node and at
// least one gateway URL. It returns the Identity msg makes, without the
// machine's own fields (MachineID, Variant, JoinedAt, the key), and the node
// CA (nil when msg has none). Errors say which check failed; those of
// pki.CheckJoinResponse match pki.ErrUntrustedJoinResponse.
func checkJoinResponse(msg *joinv1.JoinResponse, pins pki.Pins, signingSPKI []byte, pub crypto.PublicKey) (*Identity, *x509.Certificate, error) {
	v, err := pki.CheckJoinResponse(msg, pins, signingSPKI)
	if err != nil {
		return nil, nil, err
	}
	if !samePublicKey(v.Certificate, pub) {
		return nil, nil, errors.New("join response: the certificate is not for this machine's key")
	}
	id := &Identity{
		NodeID:             msg.GetNodeId(),
		GatewayURLs:        msg.GetGatewayUrls(),
		GatewayServerName:  msg.GetGatewayServerName(),
		TrustDomain:        msg.GetTrustDomain(),
		PoolID:             msg.GetPoolId(),
		CommandSigningRoot: msg.GetTrust().GetCommandSigningRoot(),
		cert:               v.Certificate,
		servingCA:          v.ServingCA,
		commandRoot:        v.CommandSigningRoot,
	}
	if id.NodeID == "" || len(id.GatewayURLs) == 0 {
		return nil, nil, errors.New("join response lacks node_id or gateway_urls")
	}
	if msg.GetNotAfter() != nil {
		id.NotAfter = msg.GetNotAfter().AsTime()
	}
	return id, v.NodeCA, nil
}

func samePublicKey(cert *x509.Certificate, pub crypto.PublicKey) bool {
	k, ok := pub.(interface{ Equal(x crypto.PublicKey) bool })
	return ok && k.Equal(cert.PublicKey)
}

// countingHardware counts the commands the daemon core runs on the machine
// (MachineStatus.Runs).
type countingHardware struct {
	Hardware
	m *Machine
}

// Run runs the command on the hardware and counts it.
func (h countingHardware) Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error) {
	h.m.update(func(s *MachineStatus) { s.Runs++ })
	return h.Hardware.Run(kind, args)
}

// gatewayTLS returns the gateway URLs (Config override, else the
// identity's) and the mTLS client configuration: the node certificate, the
// serving CA as the only root, and the server name (Config override, else
// the JoinResponse's, else the first URL's host) that every gateway replica
// presents.
func (m *Machine) gatewayTLS(id *Identity) ([]string, *tls.Config, error) {
	urls := id.GatewayURLs
	if m.r.cfg.GatewayURL != "" {
		urls = pki.SplitGatewayURLs(m.r.cfg.GatewayURL)
	}
	if len(urls) == 0 {
		return nil, nil, errors.New("no gateway url")
	}
	// The override was checked by New; the JoinResponse's URLs are checked
	// here.
	for _, raw := range urls {
		if err := pki.CheckGatewayURL(raw); err != nil {
			return nil, nil, err
		}
	}
	first, _ := url.Parse(urls[0])
	firstHost := first.Hostname()
	name := m.r.cfg.GatewayServerName
	if name == "" {
		name = id.GatewayServerName
	}
	if name == "" {
		name = firstHost
	}
	roots := x509.NewCertPool()
	roots.AddCert(id.servingCA)
	m.cert.set(id)
	return urls, &tls.Config{
		// The newest certificate: a renewal replaces it (renew.go).
		GetClientCertificate: m.cert.get,
		RootCAs:              roots,
		ServerName:           name,
		MinVersion:           tls.VersionTLS12,
		NextProtos:           []string{"h2"},
	}, nil
}
