// Package controllers runs better-compute's reconcilers: the outbox relay,
// the acceptance reconciler (joining → accepting → adopted or
// acceptance_failed, see Acceptance), the expiry of reservations at their
// end time (Expiry), the expiry of user commands at their deadline
// (CommandExpiry), the usage sink (Usage), the liveness sweeper (Liveness)
// the SSH user CAs every NodeSpec carries (SSHCAs), the removal of stale
// joins (Joining) and the deletion of rows past their retention
// (Retention). N replicas may run:
//
//   - Each reconciler runs behind a lease of its own, named LeasePrefix and
//     its name (LeaseAcceptance, LeaseExpiry, LeaseUsage, LeaseLiveness,
//     LeaseCommandExpiry, LeaseSSHCAs, LeaseJoining, LeaseRetention), so one replica works
//     at a time and another takes over within a lease TTL when it dies. None
//     relies on the lease for safety: acceptance claims nodes with FOR UPDATE
//     SKIP LOCKED and guards every transition on the node's state; Expiry
//     claims reservations with SKIP LOCKED and ends them with
//     store.EndReservation, which leaves an ended one alone; Usage writes
//     windows with ON CONFLICT DO NOTHING; SSHCAs locks the CA table; Joining
//     claims nodes with SKIP LOCKED; Retention deletes rows that are due
//     whoever deletes them, skipping locked ones. An overlap during a takeover (a stalled
//     holder still running) does no harm.
//   - The outbox relay runs on every replica without a lease: it takes rows
//     with FOR UPDATE SKIP LOCKED, so replicas share the work instead of
//     waiting on each other, and a dead replica delays no poke by a lease
//     TTL. Pokes are idempotent hints, so the rare double publish is
//     harmless.
//
// To add a reconciler, give it Name and a Run(ctx) error that stops on
// cancel (service.Runner), and add it to the list in New: that is all it
// takes to run it behind its own lease.
package controllers

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/outbox"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
)

// Name is the controllers' name in logs, errors and `controllers
// healthcheck`.
const Name = "controllers"

// Defaults of the reconcilers' fields, for those built without Config.
const (
	DefaultAcceptanceTimeout  = 2 * time.Minute
	DefaultReconcileInterval  = 2 * time.Second
	DefaultAcceptanceAttempts = 3
	DefaultBatchSize          = 500
)

// LeasePrefix starts the name of every reconciler's lease: LeasePrefix and
// the reconciler's name.
const LeasePrefix = "controllers."

// LeaseAcceptance is the lease name of the acceptance reconciler.
const LeaseAcceptance = LeasePrefix + "acceptance"

// Config configures the controllers. The binary reads it from the
// environment (pkg/config; docs/configuration.md lists the variables); New
// gives every zero field its default. With SignedIntent, every command and
// NodeSpec the controllers write is signed with
// PKIDir/command-signing.key (see pkg/store IntentSigner).
type Config struct {
	service.Database
	service.NATS
	service.PKI
	service.Intent
	service.Leases
	service.Probes `default:"HEALTH_LISTEN=:8084"`
	// AcceptanceTimeout is how long a node has to answer its acceptance
	// command (the command's deadline).
	AcceptanceTimeout time.Duration `env:"ACCEPTANCE_TIMEOUT,positive" default:"2m"`
	// AcceptanceAttempts is how many acceptance commands a node gets before
	// it fails for not answering.
	AcceptanceAttempts int `default:"3"`
	// ReconcileInterval is how often the acceptance reconciler looks for
	// work without a poke.
	ReconcileInterval time.Duration `env:"RECONCILE_INTERVAL,positive" default:"2s"`
	// BatchSize is how many nodes (reservations, commands) one reconciler
	// transaction handles.
	BatchSize int `default:"500"`
	// ExpiryInterval is how often reservations past their end, and user
	// commands past their deadline, are expired.
	ExpiryInterval time.Duration `env:"EXPIRY_INTERVAL,positive" default:"1s"`
	// UsageInterval is how often the usage sink writes final windows.
	UsageInterval time.Duration `env:"USAGE_INTERVAL,positive" default:"1m"`
	// LivenessTimeout is how long a node may go unheard before it is marked
	// unreachable; at least 20 s (store.MinLivenessTimeout, which the
	// invariant I4 needs), else the controllers do not start.
	LivenessTimeout time.Duration `env:"LIVENESS_TIMEOUT,positive" default:"30s"`
	// JoiningTimeout is how long a node may stay joining without ever
	// opening a session before it is deleted (its token gets the use back).
	JoiningTimeout time.Duration `env:"JOINING_TIMEOUT,positive" default:"1h"`
	// LivenessInterval is how often the liveness sweeper looks.
	LivenessInterval time.Duration `env:"LIVENESS_INTERVAL,positive" default:"1s"`
	// RetentionConfig is how long each kind of row is kept, and how the
	// retention reconciler deletes the rest (Retention).
	RetentionConfig
}

// Deps are the controllers' dependencies: DB and NC (the outbox's
// destination, and the pokes that wake the reconcilers) are required.
type Deps = service.Deps

// Server runs the controllers of one replica.
type Server struct {
	cfg           Config
	deps          Deps
	acceptance    *Acceptance
	expiry        *Expiry
	usage         *Usage
	liveness      *Liveness
	commandExpiry *CommandExpiry
	sshCAs        *SSHCAs
	joining       *Joining
	retention     *Retention
	// reconcilers run each behind its lease: leases[i] is reconcilers[i]'s.
	reconcilers []service.Runner
	leases      []*lease.Lease
}

// New checks cfg and deps and returns a Server; it starts nothing.
func New(cfg Config, deps Deps) (*Server, error) {
	deps, err := deps.Complete(Name, true)
	if err != nil {
		return nil, err
	}
	config.SetDefaults(&cfg)
	if cfg.Holder == "" {
		cfg.Holder = lease.DefaultHolder()
	}
	if cfg.LivenessTimeout < store.MinLivenessTimeout {
		return nil, fmt.Errorf("controllers: LivenessTimeout %s is below %s, which I4 needs", cfg.LivenessTimeout,
			store.MinLivenessTimeout)
	}
	if err := cfg.Check(cfg.JoiningTimeout); err != nil {
		return nil, err
	}
	var intent *store.IntentSigner
	if cfg.SignedIntent {
		if intent, err = store.LoadIntentSigner(cfg.PKIDir); err != nil {
			return nil, fmt.Errorf("controllers: %w", err)
		}
	}
	log := func(name string) *slog.Logger { return deps.Logger.With("reconciler", name) }
	s := &Server{cfg: cfg, deps: deps}
	s.acceptance = &Acceptance{DB: deps.DB, NC: deps.NC, Logger: log("acceptance"), Clock: deps.Clock,
		Timeout: cfg.AcceptanceTimeout, Attempts: cfg.AcceptanceAttempts, Interval: cfg.ReconcileInterval,
		Batch: cfg.BatchSize, Intent: intent}
	s.expiry = &Expiry{DB: deps.DB, Logger: log("expiry"), Clock: deps.Clock,
		Interval: cfg.ExpiryInterval, Batch: cfg.BatchSize, Intent: intent}
	s.usage = &Usage{DB: deps.DB, Logger: log("usage"), Clock: deps.Clock,
		Interval: cfg.UsageInterval, Batch: cfg.BatchSize}
	s.liveness = &Liveness{DB: deps.DB, Logger: log("liveness"), Clock: deps.Clock,
		Timeout: cfg.LivenessTimeout, Interval: cfg.LivenessInterval, Batch: cfg.BatchSize}
	s.commandExpiry = &CommandExpiry{DB: deps.DB, Logger: log("command-expiry"), Clock: deps.Clock,
		Interval: cfg.ExpiryInterval, Batch: cfg.BatchSize}
	s.joining = &Joining{DB: deps.DB, Logger: log("joining"), Clock: deps.Clock, Timeout: cfg.JoiningTimeout,
		Batch: cfg.BatchSize}
	s.retention = &Retention{DB: deps.DB, Logger: log("retention"), Clock: deps.Clock, Config: cfg.RetentionConfig}
	s.sshCAs = &SSHCAs{DB: deps.DB, Logger: log("ssh-cas"), Clock: deps.Clock, PKIDir: cfg.PKIDir, Intent: intent}
	// The reconcilers: each runs behind a lease of its own, LeasePrefix
	// and its name. To add one, add it here.
	s.reconcilers = []service.Runner{s.acceptance, s.expiry, s.usage, s.liveness, s.commandExpiry, s.sshCAs, s.joining,
		s.retention}
	for _, r := range s.reconcilers {
		s.leases = append(s.leases, cfg.Lease(LeasePrefix+r.Name(), deps))
	}
	s.liveness.Metrics, s.commandExpiry.Metrics = deps.Metrics, deps.Metrics
	// The fleet's figures are read by the replica holding the liveness
	// lease (docs/metrics.md).
	stats := s.leases[slices.Index(s.reconcilers, service.Runner(s.liveness))]
	if err := registerGauges(deps.Meter(meterName), deps.DB, s.leases, stats); err != nil {
		return nil, fmt.Errorf("controllers: metrics: %w", err)
	}
	return s, nil
}

// Acceptance returns the acceptance reconciler (for tests and tools that
// drive a pass by hand).
func (s *Server) Acceptance() *Acceptance { return s.acceptance }

// Expiry returns the expiry reconciler (for tests and tools).
func (s *Server) Expiry() *Expiry { return s.expiry }

// Usage returns the usage sink (for tests and tools).
func (s *Server) Usage() *Usage { return s.usage }

// CommandExpiry returns the command expiry reconciler (for tests and
// tools).
func (s *Server) CommandExpiry() *CommandExpiry { return s.commandExpiry }

// Liveness returns the liveness sweeper (for tests and tools).
func (s *Server) Liveness() *Liveness { return s.liveness }

// Retention returns the retention reconciler (for tests and tools).
func (s *Server) Retention() *Retention { return s.retention }

// SSHCAs returns the SSH user CA reconciler (for tests and tools).
func (s *Server) SSHCAs() *SSHCAs { return s.sshCAs }

// LeaseNames returns the names of the reconcilers' leases, in the order of the
// reconcilers.
func (s *Server) LeaseNames() []string {
	names := make([]string, len(s.leases))
	for i, l := range s.leases {
		names[i] = l.Name
	}
	return names
}

// LeaseHeld reports whether this replica holds the acceptance lease.
func (s *Server) LeaseHeld() bool { return s.leases[0].Held() }

// Name returns Name (service.Runner).
func (s *Server) Name() string { return Name }

// Run runs, through the service lifecycle (service.Run), the probes server,
// the outbox relay and, while this replica holds their leases, the
// reconcilers, until ctx ends; then it stops them, releases the leases and
// returns nil. It returns an error when the probes listener cannot be
// opened or a loop fails.
func (s *Server) Run(ctx context.Context) error {
	// The relay runs without a lease: see the package comment.
	parts := []service.Runner{&outbox.Relay{DB: s.deps.DB, NC: s.deps.NC, Logger: s.deps.Logger.With("reconciler", "outbox"),
		Clock: s.deps.Clock, Metrics: s.deps.Metrics}}
	for i, r := range s.reconcilers {
		parts = append(parts, service.Leased(s.leases[i], r))
	}
	s.deps.Logger.Info("controllers starting", "holder", s.cfg.Holder)
	return service.Run(ctx, service.Spec{Name: Name, Deps: s.deps, Parts: parts, Servers: s.cfg.Servers()})
}
