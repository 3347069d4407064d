package controllers

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/store"
)

// LeaseRetention is the lease name of the retention reconciler.
const LeaseRetention = LeasePrefix + "retention"

// Defaults of the retention settings (RetentionConfig).
const (
	DefaultRetentionEvents       = 30 * 24 * time.Hour
	DefaultRetentionAudit        = 365 * 24 * time.Hour
	DefaultRetentionCommands     = 30 * 24 * time.Hour
	DefaultRetentionReservations = 90 * 24 * time.Hour
	DefaultRetentionUsage        = 400 * 24 * time.Hour
	DefaultRetentionCerts        = 30 * 24 * time.Hour
	DefaultRetentionJoinTokens   = 7 * 24 * time.Hour
	DefaultRetentionInterval     = time.Hour
	DefaultRetentionBatch        = 1000
	DefaultRetentionPause        = 50 * time.Millisecond
)

// The shortest retentions RetentionConfig.Check accepts, each for the
// horizon a shorter one would break.
const (
	// MinRetentionEvents: an event must outlive the watch's hold of events
	// for transactions still running at a read (services/api WatchConfig
	// MaxGrace, 1 min) and the writers' clock skew by far, so that
	// retention never deletes above an event that may still commit; and a
	// watch client reconnecting with backoff must find its cursor kept.
	MinRetentionEvents = time.Hour
	// MinRetentionCommands is the longest command timeout (24 h,
	// compute.proto RunCommandRequest.timeout): RunCommand is idempotent by
	// request id, so a client retrying within its command's timeout must
	// find the command it queued, not queue it again (I2).
	MinRetentionCommands = 24 * time.Hour
	// MinRetentionReservations: Reserve is idempotent by request id too,
	// and a reservation's sandbox SSH certificates and tunnels (at most 1 h)
	// are checked against it; a day covers both.
	MinRetentionReservations = 24 * time.Hour
	// MinRetentionCerts: the gateway closes a session within one resync
	// after its certificate expired and reads the certificate's row until
	// then (store.GetSessionCert); an hour covers that.
	MinRetentionCerts = time.Hour
)

// RetentionConfig are the retention settings: how long each kind of row is
// kept (docs/architecture.md, "Retention"). Zero fields take their
// defaults; a value that is not positive (config.Load), or below the
// horizon it would break (Check), is refused. To keep a kind (almost) for
// ever, give it a long retention (876000h is a century).
type RetentionConfig struct {
	// RetentionEvents is how long an event is kept after it was written;
	// at least MinRetentionEvents (1h). A watch resuming after an id
	// retention deleted is refused (FailedPrecondition).
	RetentionEvents time.Duration `env:"RETENTION_EVENTS,positive" default:"720h"`
	// RetentionAudit is how long an audit row is kept after its call.
	RetentionAudit time.Duration `env:"RETENTION_AUDIT,positive" default:"8760h"`
	// RetentionCommands is how long a command is kept after it finished
	// (succeeded, failed, expired); at least MinRetentionCommands (24h, the
	// longest command timeout).
	RetentionCommands time.Duration `env:"RETENTION_COMMANDS,positive" default:"720h"`
	// RetentionReservations is how long a reservation is kept, with its
	// bookings, after it ended (released, expired, failed); at least
	// MinRetentionReservations (24h).
	RetentionReservations time.Duration `env:"RETENTION_RESERVATIONS,positive" default:"2160h"`
	// RetentionUsage is how long a usage window is kept after its hour
	// began; at least RetentionReservations, since the usage sink writes
	// again the windows of a reservation it still has.
	RetentionUsage time.Duration `env:"RETENTION_USAGE,positive" default:"9600h"`
	// RetentionCerts is how long a node certificate is kept after it
	// expired (revoked or not; a node's newest is always kept); at least
	// MinRetentionCerts (1h).
	RetentionCerts time.Duration `env:"RETENTION_CERTS,positive" default:"720h"`
	// RetentionJoinTokens is how long a join token is kept after it expired
	// or was revoked; at least JOINING_TIMEOUT, so that a node still joining
	// with it can give it its use back.
	RetentionJoinTokens time.Duration `env:"RETENTION_JOIN_TOKENS,positive" default:"168h"`
	// RetentionInterval is how often a retention pass runs.
	RetentionInterval time.Duration `env:"RETENTION_INTERVAL,positive" default:"1h"`
	// RetentionBatch is how many rows one retention statement (one short
	// transaction) deletes at most.
	RetentionBatch int `env:"RETENTION_BATCH,positive" default:"1000"`
	// RetentionPause is the pause after each retention batch that deleted
	// a full batch, which leaves the database to the hot paths between
	// them; 0 takes the default.
	RetentionPause time.Duration `env:"RETENTION_PAUSE" default:"50ms"`
}

// Check refuses, with an error that names the variable
// (BETTER_COMPUTE_RETENTION_…), a retention, interval or batch that is not
// positive, a negative pause, a retention below the horizon it would break
// (the Min* constants; join tokens: joiningTimeout, JOINING_TIMEOUT), and
// usage windows kept for less time than reservations. Zero fields are
// checked as their defaults.
func (c RetentionConfig) Check(joiningTimeout time.Duration) error {
	config.SetDefaults(&c)
	refuse := func(name, format string, args ...any) error {
		return &config.Error{Name: config.Prefix + name, Err: fmt.Errorf(format, args...)}
	}
	for _, v := range []struct {
		name string
		d    time.Duration
		min  time.Duration
		why  string
	}{
		{"RETENTION_EVENTS", c.RetentionEvents, MinRetentionEvents, "the events watch's horizon (MaxGrace, reconnects)"},
		{"RETENTION_AUDIT", c.RetentionAudit, 0, ""},
		{"RETENTION_COMMANDS", c.RetentionCommands, MinRetentionCommands, "the longest command timeout (a RunCommand retried with its request id)"},
		{"RETENTION_RESERVATIONS", c.RetentionReservations, MinRetentionReservations, "a Reserve retried with its request id, a sandbox's certificates and tunnels"},
		{"RETENTION_USAGE", c.RetentionUsage, c.RetentionReservations, "RETENTION_RESERVATIONS: the usage sink would write again the windows of a reservation still kept"},
		{"RETENTION_CERTS", c.RetentionCerts, MinRetentionCerts, "the gateway's hold of an expired certificate's session"},
		{"RETENTION_JOIN_TOKENS", c.RetentionJoinTokens, joiningTimeout, "JOINING_TIMEOUT: a node still joining gives its token its use back"},
		{"RETENTION_INTERVAL", c.RetentionInterval, 0, ""},
	} {
		switch {
		case v.d <= 0:
			return refuse(v.name, "must be positive, got %s", v.d)
		case v.d < v.min:
			return refuse(v.name, "%s is below %s, %s", v.d, v.min, v.why)
		}
	}
	switch {
	case c.RetentionBatch <= 0:
		return refuse("RETENTION_BATCH", "must be positive, got %d", c.RetentionBatch)
	case c.RetentionPause < 0:
		return refuse("RETENTION_PAUSE", "must not be negative, got %s", c.RetentionPause)
	}
	return nil
}

// Retention is the retention reconciler (docs/architecture.md,
// "Retention"): every Interval it deletes the rows older than their
// retention, kind by kind (events, audit rows, finished commands, ended
// reservations with their bookings, usage windows, expired node
// certificates, stale join tokens), each in statements of at most Batch
// rows (pkg/store retention.go: each statement its own short transaction,
// through an index), with Pause between them. Two replicas overlapping during a lease takeover delete the same
// rows at worst: a row deleted twice is deleted once, and rows locked by
// the other are skipped.
type Retention struct {
	// DB is the database; required.
	DB *store.DB
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
	// Config holds the retentions, Interval, Batch and Pause; zero fields
	// take their defaults (a zero Pause too).
	Config RetentionConfig
}

// Name returns "retention" (service.Runner); its lease is LeaseRetention.
func (r *Retention) Name() string { return "retention" }

// Run runs a pass every Interval until ctx ends; it returns nil then. A
// failed pass is logged and retried at the next tick.
func (r *Retention) Run(ctx context.Context) error {
	return every(ctx, clockOf(r.Clock, r.DB), positive(r.Config.RetentionInterval, DefaultRetentionInterval), r.Logger,
		"retention", r.Reconcile)
}

// RetentionPass is what one pass deleted, per kind.
type RetentionPass struct {
	Events, Audit, Commands, Reservations, UsageWindows, NodeCerts, JoinTokens int
	// Batches is how many statements deleted rows (each at most Batch).
	Batches int
}

// Total is the number of rows the pass deleted.
func (p RetentionPass) Total() int {
	return p.Events + p.Audit + p.Commands + p.Reservations + p.UsageWindows + p.NodeCerts + p.JoinTokens
}

// Reconcile runs one pass: for each kind with a retention, it deletes Batch
// rows at a time until a batch deletes fewer, pausing Pause after each, and
// returns what it deleted (so far, with the error, when one fails or ctx
// ends).
func (r *Retention) Reconcile(ctx context.Context) (RetentionPass, error) {
	clk := clockOf(r.Clock, r.DB)
	c := r.Config
	config.SetDefaults(&c)
	batch := c.RetentionBatch
	now := clk.Now().UTC().Truncate(time.Microsecond)
	var pass RetentionPass
	for _, k := range []struct {
		name   string
		keep   time.Duration
		delete func(context.Context, store.DBTX, time.Time, int) (int, error)
		count  *int
	}{
		{"events", c.RetentionEvents, store.DeleteOldEvents, &pass.Events},
		{"audit", c.RetentionAudit, store.DeleteOldAudit, &pass.Audit},
		{"commands", c.RetentionCommands, store.DeleteOldCommands, &pass.Commands},
		// A reservation's usage windows outlive it (migration 000018).
		{"reservations", c.RetentionReservations, store.DeleteOldReservations, &pass.Reservations},
		{"usage_windows", c.RetentionUsage, store.DeleteOldUsageWindows, &pass.UsageWindows},
		{"node_certs", c.RetentionCerts, store.DeleteOldNodeCerts, &pass.NodeCerts},
		{"join_tokens", c.RetentionJoinTokens, store.DeleteOldJoinTokens, &pass.JoinTokens},
	} {
		before := now.Add(-k.keep)
		for {
			n, err := k.delete(ctx, r.DB.Pool, before, batch)
			if err != nil {
				return pass, fmt.Errorf("retention of %s: %w", k.name, err)
			}
			*k.count += n
			if n > 0 {
				pass.Batches++
			}
			if n < batch {
				break
			}
			if err := clock.Sleep(ctx, clk, c.RetentionPause); err != nil {
				return pass, err
			}
		}
		if *k.count > 0 {
			logger(r.Logger).Info("retention deleted rows", "kind", k.name, "rows", *k.count, "before", before)
		}
	}
	return pass, nil
}
