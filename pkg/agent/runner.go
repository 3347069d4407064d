package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// DefaultTokenWait is how long a Runner waits for Config.TokenFile by
// default.
const DefaultTokenWait = 2 * time.Minute

// DefaultJoinConcurrency is how many Joins a Runner has in flight at most
// by default (Config.JoinConcurrency): a machine's first start joins once,
// so the cap matters only to a Runner of many machines, where it bounds
// the keys generated and the JoinService requests open at once.
const DefaultJoinConcurrency = 16

// Session transports (Config.SessionTransport).
const (
	// SessionFramed carries each session on a TLS connection of its own
	// (pkg/sessionwire), and falls back to SessionConnect for a gateway
	// that refuses it.
	SessionFramed = "framed"
	// SessionConnect carries sessions as Connect streams over HTTP/2.
	SessionConnect = "connect"
)

// Config configures a Runner. Zero fields take the defaults named.
//
// To join, a machine needs JoinService's public keys and the pins to check
// them and the signed JoinResponse against: the keys come from Server's
// well-known document or from JoinEncryptionKey and JoinSigningKey; the
// pins from Pins (servingCa, joinSigning and joinEncryption are required;
// commandSigning is checked when given). A machine that has joined before
// needs none of this.
type Config struct {
	// Server is the deployment's public API base URL: its well-known document
	// (pki.WellKnownPath) gives the join URL, the gateway and JoinService's
	// public keys, each checked against Pins before use.
	Server string
	// Pins are the deployment's pins (pki.Pins, as `pki init` writes them in
	// pins.json).
	Pins pki.Pins
	// InsecureTrustServerPins takes the pins from Server's well-known
	// document itself instead of Pins (trust on first use): whoever answers
	// for Server then chooses the keys this machine trusts. For development
	// only; it is logged as a warning.
	InsecureTrustServerPins bool
	// JoinEncryptionKey and JoinSigningKey are JoinService's public keys
	// (DER SubjectPublicKeyInfo), used when Server is empty; they are
	// checked against Pins too.
	JoinEncryptionKey, JoinSigningKey []byte
	// CommandSigningKey is the command-signing root (DER
	// SubjectPublicKeyInfo), used when Server is empty: when it and
	// Pins.CommandSigning are both given, the key is checked against the pin
	// before Join (with Server, the document's commandSigningKey is).
	CommandSigningKey []byte
	// JoinURL is JoinService's base URL (default: the well-known document's
	// joinUrl with Server; required to join without Server).
	JoinURL string
	// Token is the join token in clear text ("bcjt_…"); it wins over
	// TokenFile. It is only ever sent sealed to JoinService's key.
	Token string
	// TokenFile is a file holding the join token, waited for up to
	// TokenWait (compose's bootstrap writes it).
	TokenFile string
	// TokenWait is how long to wait for TokenFile to appear (default 2 min).
	TokenWait time.Duration
	// DataDir holds one directory per machine, DataDir/<index>
	// (required).
	DataDir string
	// Nodes is how many machines to run (default 1).
	Nodes int
	// GatewayURL overrides the gateway URLs of the JoinResponse: one URL or
	// several separated by commas (one per gateway replica), each
	// https://HOST[:PORT] (see pki.ParseGatewayURLs; New refuses others).
	GatewayURL string
	// GatewayServerName overrides the TLS server name to verify on the
	// gateway (default: the JoinResponse's, else the host of the URL).
	GatewayServerName string
	// HealthListen is the address of the /healthz server ("" for none).
	HealthListen string
	// AgentVersion is reported in the Join claims and in Hello (required),
	// e.g. "fakedaemon/0.1.0".
	AgentVersion string
	// Core is the template of each machine's daemon core configuration
	// (backoff, timeouts); NodeID, AgentVersion, Logger, the certificate's
	// times and the command-signing root are filled in.
	Core daemon.Config
	// JoinBackoffMin and JoinBackoffMax bound the delay between Join
	// attempts after transient errors (defaults 500 ms and 15 s).
	JoinBackoffMin, JoinBackoffMax time.Duration
	// JoinConcurrency caps the Joins in flight across the Runner's
	// machines (default DefaultJoinConcurrency).
	JoinConcurrency int
	// SessionTransport is how sessions reach the gateways: SessionFramed
	// (the default) or SessionConnect. Tunnels always use Connect.
	SessionTransport string
	// JoinOnly makes Run return once every machine has joined (or had
	// joined before), without opening sessions or the health server
	// (`fakedaemon join`).
	JoinOnly bool
}

func (c *Config) setDefaults() {
	if c.TokenWait <= 0 {
		c.TokenWait = DefaultTokenWait
	}
	if c.Nodes <= 0 {
		c.Nodes = 1
	}
	if c.JoinBackoffMin <= 0 {
		c.JoinBackoffMin = 500 * time.Millisecond
	}
	if c.JoinBackoffMax <= 0 {
		c.JoinBackoffMax = 15 * time.Second
	}
	if c.JoinConcurrency <= 0 {
		c.JoinConcurrency = DefaultJoinConcurrency
	}
	if c.SessionTransport == "" {
		c.SessionTransport = SessionFramed
	}
}

// Deps are a Runner's dependencies.
type Deps struct {
	// Logger receives JSON logs; nil discards them.
	Logger *slog.Logger
	// Clock times backoff, token waits and the daemon cores (default real).
	Clock clock.Clock
	// JoinHTTPClient calls JoinService and fetches the well-known document
	// (default: a client with a 30 s timeout that keeps as many idle
	// connections as Config.JoinConcurrency).
	JoinHTTPClient *http.Client
	// HealthListener, when set, serves /healthz instead of listening on
	// Config.HealthListen (tests pass a listener on a free port).
	HealthListener net.Listener
	// Hardware makes each machine's Hardware at its start (required).
	Hardware HardwareFunc
}

// joinHTTPClient is a Runner's default Deps.JoinHTTPClient: a 30 s timeout,
// and http.DefaultTransport's settings except that it keeps up to
// inFlight idle connections per host (DefaultTransport keeps two): the
// Runner's machines reuse the connections of the Joins before theirs, rather
// than each opening one (a TCP handshake, and with https a TLS one, on both
// sides) when many answers arrive at once.
func joinHTTPClient(inFlight int) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = max(inFlight, tr.MaxIdleConnsPerHost)
	tr.MaxIdleConns = max(inFlight, tr.MaxIdleConns)
	return &http.Client{Timeout: 30 * time.Second, Transport: tr}
}

// Runner runs Config.Nodes machines. Make one with New and call Run, or use
// Start.
type Runner struct {
	cfg        Config
	log        *slog.Logger
	clk        clock.Clock
	httpClient *http.Client // calls JoinService and fetches the well-known document
	clientOpts []connect.ClientOption
	joinSem    chan struct{}
	hardware   HardwareFunc
	machines   []*Machine
	healthLn   net.Listener

	tokenMu sync.Mutex
	token   string

	trustMu sync.Mutex
	trust   *joinTrust // resolved once for all machines (jointrust.go)

	done chan struct{}
	err  error
}

// MaxNodes is the most machines one process runs (Config.Nodes): each holds
// a key, a TLS session and a journal, so a count off by some orders of
// magnitude would exhaust the host's memory before anything failed.
const MaxNodes = 20000

// New validates cfg and returns a Runner. It fails for a negative node
// count or one above MaxNodes, an unknown SessionTransport, a malformed GatewayURL
// (pki.ParseGatewayURLs), a malformed pin, InsecureTrustServerPins without
// Server, and without DataDir, AgentVersion or deps.Hardware.
func New(cfg Config, deps Deps) (*Runner, error) {
	if cfg.Nodes < 0 || cfg.Nodes > MaxNodes {
		return nil, fmt.Errorf("nodes must be from 1 to %d, got %d", MaxNodes, cfg.Nodes)
	}
	if _, err := pki.ParseGatewayURLs(cfg.GatewayURL); err != nil {
		return nil, fmt.Errorf("gateway url override (--gateway-url): %w", err)
	}
	if err := cfg.Pins.Validate(); err != nil {
		return nil, fmt.Errorf("pins: %w", err)
	}
	if t := cfg.SessionTransport; t != "" && t != SessionFramed && t != SessionConnect {
		return nil, fmt.Errorf("session transport (--session-transport) must be %s or %s, got %q", SessionFramed, SessionConnect, t)
	}
	if cfg.InsecureTrustServerPins && cfg.Server == "" {
		return nil, errors.New("trusting the server's pins needs a server (--server)")
	}
	switch {
	case cfg.DataDir == "":
		return nil, errors.New("a data directory is required (--data-dir)")
	case cfg.AgentVersion == "":
		return nil, errors.New("an agent version is required")
	case deps.Hardware == nil:
		return nil, errors.New("no hardware (Deps.Hardware)")
	}
	cfg.setDefaults()
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.Clock == nil {
		deps.Clock = clock.New()
	}
	if deps.JoinHTTPClient == nil {
		deps.JoinHTTPClient = joinHTTPClient(cfg.JoinConcurrency)
	}
	r := &Runner{
		cfg:        cfg,
		log:        deps.Logger,
		clk:        deps.Clock,
		httpClient: deps.JoinHTTPClient,
		clientOpts: service.ClientOptions(telemetry.NoMetrics()),
		joinSem:    make(chan struct{}, cfg.JoinConcurrency),
		hardware:   deps.Hardware,
		healthLn:   deps.HealthListener,
		done:       make(chan struct{}),
	}
	for i := range cfg.Nodes {
		r.machines = append(r.machines, &Machine{
			r:     r,
			index: i,
			dir:   filepath.Join(cfg.DataDir, strconv.Itoa(i)),
			log:   deps.Logger.With("machine", i),
			st:    MachineStatus{Index: i},
		})
	}
	return r, nil
}

// Start makes a Runner and runs it in the background until ctx ends or a
// machine fails (a refused Join); Wait returns the outcome.
func Start(ctx context.Context, cfg Config, deps Deps) (*Runner, error) {
	r, err := New(cfg, deps)
	if err != nil {
		return nil, err
	}
	go func() { _ = r.Run(ctx) }()
	return r, nil
}

// Run runs every machine and the health server until ctx ends (then it
// returns nil) or a machine fails: a refused Join (*JoinRefusedError), a
// token that never appeared, or an unusable data directory. With JoinOnly, a
// refused Join is only that machine's (MachineStatus.JoinError): the others
// go on, and Run returns an error counting the refused machines that wraps
// the first refusal. A machine that stops for good (revoked, certificate
// expired) ends nothing: see HealthHandler.
func (r *Runner) Run(ctx context.Context) error {
	defer close(r.done)
	g, gctx := errgroup.WithContext(ctx)
	if err := os.MkdirAll(r.cfg.DataDir, 0o700); err != nil {
		r.err = fmt.Errorf("data dir: %w", err)
		return r.err
	}
	for _, m := range r.machines {
		g.Go(func() error {
			err := m.run(gctx)
			var refused *JoinRefusedError
			if r.cfg.JoinOnly && errors.As(err, &refused) {
				// Joining only, a refusal is this machine's: the others
				// go on, and Run reports every refusal at the end.
				m.update(func(s *MachineStatus) { s.JoinError = err.Error() })
				m.refusal = refused
				return nil
			}
			return err
		})
	}
	if !r.cfg.JoinOnly && (r.cfg.HealthListen != "" || r.healthLn != nil) {
		mux := http.NewServeMux()
		mux.Handle("/healthz", r.HealthHandler())
		srv := service.NewServer(r.cfg.HealthListen, mux, service.HTTPLimits{})
		g.Go(func() error { return service.Serve(gctx, r.log, srv, r.healthLn) })
	}
	err := g.Wait()
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		err = nil
	}
	if err == nil && r.cfg.JoinOnly {
		err = r.joinErrors()
	}
	r.err = err
	return err
}

// joinErrors returns nil when no machine's Join was refused (JoinOnly), else
// an error counting the refused machines and wrapping the first refusal
// (*JoinRefusedError).
func (r *Runner) joinErrors() error {
	var first error
	n := 0
	for _, m := range r.machines {
		if m.refusal == nil { // written before its goroutine ended (g.Wait)
			continue
		}
		n++
		if first == nil {
			first = fmt.Errorf("machine %d: %w", m.index, m.refusal)
		}
	}
	if n == 0 {
		return nil
	}
	return fmt.Errorf("%d of %d machines could not join: %w", n, len(r.machines), first)
}

// Done is closed when Run has returned.
func (r *Runner) Done() <-chan struct{} { return r.done }

// Wait waits for Run to return and returns its error.
func (r *Runner) Wait() error {
	<-r.done
	return r.err
}

// Machines returns the handles of the machines, in index order.
func (r *Runner) Machines() []*Machine { return r.machines }

// Ready returns nil once every machine has joined and none has stopped for
// good; else an error naming the first machine that stopped (its node was
// revoked or its certificate expired: it must join again) or saying how
// many have not joined.
func (r *Runner) Ready() error {
	var waiting int
	for _, m := range r.machines {
		st := m.Status()
		if st.Stopped != "" {
			return fmt.Errorf("machine %d (node %s) stopped for good: %s", st.Index, st.NodeID, st.Stopped)
		}
		if !st.Joined {
			waiting++
		}
	}
	if waiting > 0 {
		return fmt.Errorf("%d of %d machines have not joined yet", waiting, len(r.machines))
	}
	return nil
}

// HealthHandler answers GET /healthz: 200 once every machine has joined, 503
// while any machine has stopped for good (Ready). A stopped machine does not
// end the Runner: the others go on, and the process stays up reporting
// unhealthy rather than exiting into a restart loop that cannot help.
func (r *Runner) HealthHandler() http.Handler {
	return service.HealthHandler(func(context.Context) error { return r.Ready() })
}

// readToken returns the join token, waiting for TokenFile when needed. All
// machines share one read.
func (r *Runner) readToken(ctx context.Context) (string, error) {
	r.tokenMu.Lock()
	defer r.tokenMu.Unlock()
	if r.token != "" {
		return r.token, nil
	}
	if t := strings.TrimSpace(r.cfg.Token); t != "" {
		r.token = t
		return t, nil
	}
	if r.cfg.TokenFile == "" {
		return "", errors.New("no join token: set --token-file (BETTER_COMPUTE_JOIN_TOKEN_FILE) or BETTER_COMPUTE_JOIN_TOKEN")
	}
	deadline := r.clk.Now().Add(r.cfg.TokenWait)
	logged := false
	for {
		b, err := os.ReadFile(r.cfg.TokenFile)
		empty := false
		if err == nil {
			if t := strings.TrimSpace(string(b)); t != "" {
				r.token = t
				return t, nil
			}
			empty = true // maybe still being written: wait
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("join token file: %w", err)
		}
		if !r.clk.Now().Before(deadline) {
			if empty {
				return "", fmt.Errorf("no join token: %s is empty (waited %s for a token in it)", r.cfg.TokenFile, r.cfg.TokenWait)
			}
			return "", fmt.Errorf("no join token: %s did not appear within %s", r.cfg.TokenFile, r.cfg.TokenWait)
		}
		if !logged {
			r.log.Info("waiting for the join token file", "path", r.cfg.TokenFile)
			logged = true
		}
		if err := clock.Sleep(ctx, r.clk, 250*time.Millisecond); err != nil {
			return "", err
		}
	}
}
