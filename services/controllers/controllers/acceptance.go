package controllers

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/acceptance"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// LabelPool and LabelSite are the labels of an adopted node's first
// NodeSpec: its pool and site ids.
const (
	LabelPool = "better-compute.io/pool"
	LabelSite = "better-compute.io/site"
)

// Acceptance is the acceptance reconciler (docs/architecture.md, "Acceptance and adoption"). Each pass:
//
//  1. Start: claims joining nodes (FOR UPDATE SKIP LOCKED, Batch at a time),
//     queues a retry-safe diag.nvml command with purpose 'acceptance' and
//     deadline now+Timeout for each, sets them accepting and pokes their
//     gateways — one transaction per batch.
//  2. Evaluate: claims accepting nodes whose latest acceptance command is
//     terminal or past its deadline, and per batch, in one transaction:
//     succeeded → pkg/acceptance against the pool's rules → adopted (spec
//     generation 1, inventory, node_devices, a poke so the gateway sends
//     DesiredState) or acceptance_failed (with the inventory and the
//     node_devices it reported, so operators see the GPUs found; the
//     scheduler places on adopted nodes only); failed or canceled →
//     acceptance_failed "diag.nvml failed: <error>"; past its deadline →
//     the command is expired, its error saying what happened by the state
//     it was in (queued: not delivered, the node was not connected;
//     delivered: not started; running: not finished), and a fresh one
//     queued, up to Attempts commands that reached the node (undelivered
//     ones, while it had no session, do not count), then acceptance_failed
//     with the same account of the last one, e.g. "diag.nvml started but
//     did not finish within 2m0s (3 attempts)".
//     Each outcome writes a node.adopted or node.acceptance_failed event
//     for the pool owner's tenant in the same transaction.
//
// Two reconcilers running at once never give a node two live acceptance
// commands or two outcomes: nodes are locked with SKIP LOCKED, re-read after
// locking, and every update is conditioned on the node's state.
type Acceptance struct {
	// DB is the database; required.
	DB *store.DB
	// NC delivers the pokes that wake the reconciler; nil polls only.
	NC *nats.Conn
	// Logger defaults to telemetry.Discard().
	Logger *slog.Logger
	// Clock defaults to DB.Clock.
	Clock clock.Clock
	// Timeout is each acceptance command's deadline from its creation;
	// DefaultAcceptanceTimeout if zero.
	Timeout time.Duration
	// Attempts is how many acceptance commands a node gets;
	// DefaultAcceptanceAttempts if zero.
	Attempts int
	// Interval is how often Run looks without a poke;
	// DefaultReconcileInterval if zero.
	Interval time.Duration
	// Batch is how many nodes one transaction handles; DefaultBatchSize if
	// zero.
	Batch int
	// Intent signs the acceptance commands and the first NodeSpecs
	// (signedIntent); nil leaves them unsigned.
	Intent *store.IntentSigner
}

// PassResult counts what one Reconcile pass did.
type PassResult struct {
	// Started is how many joining nodes got their first acceptance command.
	Started int
	// Adopted is how many nodes were adopted.
	Adopted int
	// Failed is how many nodes failed acceptance.
	Failed int
	// Retried is how many nodes got a fresh command after the previous one
	// ran out of time.
	Retried int
}

func (a *Acceptance) timeout() time.Duration {
	if a.Timeout > 0 {
		return a.Timeout
	}
	return DefaultAcceptanceTimeout
}

func (a *Acceptance) attempts() int {
	if a.Attempts > 0 {
		return a.Attempts
	}
	return DefaultAcceptanceAttempts
}

func (a *Acceptance) batch() int {
	if a.Batch > 0 {
		return a.Batch
	}
	return DefaultBatchSize
}

func (a *Acceptance) clock() clock.Clock {
	if a.Clock != nil {
		return a.Clock
	}
	return a.DB.Clock
}

func (a *Acceptance) log() *slog.Logger {
	if a.Logger != nil {
		return a.Logger
	}
	return telemetry.Discard()
}

func (a *Acceptance) now() time.Time { return a.clock().Now().UTC().Truncate(time.Microsecond) }

// Name returns "acceptance" (service.Runner); its lease is LeasePrefix + "acceptance".
func (a *Acceptance) Name() string { return "acceptance" }

// Run reconciles on every poke on store.SubjectPokeControllers (pokes that
// arrive during a pass coalesce into one more pass) and every Interval,
// until ctx ends; it returns nil then. A failed pass is logged and retried
// at the next wake-up.
func (a *Acceptance) Run(ctx context.Context) error {
	interval := a.Interval
	if interval <= 0 {
		interval = DefaultReconcileInterval
	}
	wake := make(chan struct{}, 1)
	if a.NC != nil {
		sub, err := a.NC.Subscribe(store.SubjectPokeControllers, func(*nats.Msg) {
			select {
			case wake <- struct{}{}:
			default:
			}
		})
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", store.SubjectPokeControllers, err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	tick := a.clock().NewTicker(interval)
	defer tick.Stop()
	for {
		if _, err := a.Reconcile(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			a.log().Warn("acceptance pass failed", telemetry.KeyError, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-tick.C():
		}
	}
}

// Reconcile runs one pass: it starts acceptance for every joining node and
// evaluates every accepting node that is due, Batch nodes per transaction,
// until none is left.
func (a *Acceptance) Reconcile(ctx context.Context) (PassResult, error) {
	var res PassResult
	// A pass woken for one side (a join, or an answer) finds nothing on
	// the other: one read that locks nothing says so for both sides,
	// without a transaction.
	work, err := store.AnyAcceptanceWork(ctx, a.DB.Pool, a.now())
	if err != nil {
		return res, err
	}
	for work.Joining {
		n, err := a.startBatch(ctx)
		res.Started += n
		if err != nil {
			return res, err
		}
		if n < a.batch() {
			break
		}
	}
	// Starting makes no acceptance due: the read before it stands.
	for work.Due {
		claimed, br, err := a.evaluateBatch(ctx)
		res.Adopted += br.Adopted
		res.Failed += br.Failed
		res.Retried += br.Retried
		if err != nil {
			return res, err
		}
		// Stop when the batch was not full, or when it changed nothing (its
		// nodes raced with their gateways and are looked at next pass).
		if claimed < a.batch() || br.Adopted+br.Failed+br.Retried == 0 {
			break
		}
	}
	if res != (PassResult{}) {
		a.log().Info("acceptance pass", "started", res.Started, "adopted", res.Adopted,
			"failed", res.Failed, "retried", res.Retried)
	}
	return res, nil
}

// startBatch moves up to Batch joining nodes to accepting with their first
// acceptance command and returns how many.
func (a *Acceptance) startBatch(ctx context.Context) (int, error) {
	var started int
	err := a.DB.InTx(ctx, func(tx pgx.Tx) error {
		started = 0
		now := a.now()
		nodes, err := store.ClaimJoiningNodes(ctx, tx, a.batch())
		if err != nil || len(nodes) == 0 {
			return err
		}
		cmds := make([]store.NewAcceptanceCommand, len(nodes))
		for i, n := range nodes {
			cmds[i] = store.NewAcceptanceCommand{ID: ids.New(ids.Command, now), NodeID: n}
		}
		// The commands, the move to accepting and the gateways' pokes: one
		// statement.
		moved, err := store.StartAcceptance(ctx, tx, a.Intent, now, now.Add(a.timeout()), cmds)
		started = len(moved)
		return err
	})
	return started, err
}

// evaluateBatch decides about up to Batch due accepting nodes and returns
// how many it claimed and what it did.
func (a *Acceptance) evaluateBatch(ctx context.Context) (int, PassResult, error) {
	var (
		claimed int
		res     PassResult
		logs    []func()
	)
	err := a.DB.InTx(ctx, func(tx pgx.Tx) error {
		claimed, res, logs = 0, PassResult{}, nil
		now := a.now()
		nodes, err := store.ClaimDueAcceptances(ctx, tx, now, a.batch())
		if err != nil || len(nodes) == 0 {
			return err
		}
		claimed = len(nodes)
		// Re-read after locking: this statement's snapshot sees whatever a
		// transaction that held these nodes committed.
		checks, err := store.AcceptanceChecks(ctx, tx, nodes)
		if err != nil {
			return err
		}
		var (
			adopt   []store.Adoption
			fail    []store.AcceptanceFailure
			retry   []expiredCheck
			overdue []store.AcceptanceCheck
		)
		for _, c := range checks {
			switch c.CommandState {
			case "succeeded":
				ad, f := a.judge(c)
				if ad != nil {
					adopt = append(adopt, *ad)
				} else {
					fail = append(fail, *f)
				}
			case "failed", "canceled":
				reason := "diag.nvml failed"
				if c.CommandState == "canceled" {
					reason = "diag.nvml was canceled"
				}
				if c.CommandError != "" {
					reason += ": " + c.CommandError
				}
				fail = append(fail, failure(c, reason, nil))
			case "expired", "":
				retry = append(retry, expiredCheck{AcceptanceCheck: c})
			default: // queued, delivered, running
				if !c.CommandDeadline.After(now) {
					overdue = append(overdue, c)
				}
			}
		}
		if len(overdue) > 0 {
			cmdIDs := make([]string, len(overdue))
			for i, c := range overdue {
				cmdIDs[i] = c.CommandID
			}
			expired, err := store.ExpireCommands(ctx, tx, now, cmdIDs, acceptanceExpiryReasons)
			if err != nil {
				return err
			}
			// A command that finished meanwhile is evaluated next pass.
			stateAtExpiry := make(map[string]string, len(expired))
			for _, e := range expired {
				stateAtExpiry[e.ID] = e.State
			}
			for _, c := range overdue {
				if st, ok := stateAtExpiry[c.CommandID]; ok {
					retry = append(retry, expiredCheck{AcceptanceCheck: c, expiredIn: st})
				}
			}
		}
		var fresh []store.NewAcceptanceCommand
		var freshNodes []string
		for _, c := range retry {
			if c.Attempts >= a.attempts() {
				fail = append(fail, failure(c.AcceptanceCheck, a.outOfTimeReason(c), nil))
				continue
			}
			fresh = append(fresh, store.NewAcceptanceCommand{ID: ids.New(ids.Command, now), NodeID: c.NodeID})
			freshNodes = append(freshNodes, c.NodeID)
			logs = append(logs, func() {
				a.log().Info("acceptance command ran out of time; queued another", telemetry.KeyNodeID, c.NodeID,
					"expired_in_state", c.expiredIn, "attempt", c.Attempts+1)
			})
		}
		if err := store.QueueAcceptanceCommands(ctx, tx, a.Intent, now, now.Add(a.timeout()), fresh); err != nil {
			return err
		}
		if _, err := store.MarkNodesAccepting(ctx, tx, now, freshNodes); err != nil {
			return err
		}
		adopted, err := store.AdoptNodes(ctx, tx, a.Intent, now, adopt)
		if err != nil {
			return err
		}
		failed, err := store.FailAcceptance(ctx, tx, now, fail)
		if err != nil {
			return err
		}
		// Adopted nodes get their DesiredState, retried ones their command
		// (AdoptNodes poked the scheduler).
		if err := store.PokeNodes(ctx, tx, now, append(adopted, freshNodes...)...); err != nil {
			return err
		}
		res = PassResult{Adopted: len(adopted), Failed: len(failed), Retried: len(fresh)}
		for _, id := range adopted {
			logs = append(logs, func() { a.log().Info("node adopted", telemetry.KeyNodeID, id) })
		}
		reasons := make(map[string]store.AcceptanceFailure, len(fail))
		for _, f := range fail {
			reasons[f.NodeID] = f
		}
		for _, id := range failed {
			f := reasons[id]
			logs = append(logs, func() {
				a.log().Info("node failed acceptance", telemetry.KeyNodeID, id, telemetry.KeyPoolID, f.PoolID,
					"reason", f.Reason)
			})
		}
		return nil
	})
	if err != nil {
		return claimed, PassResult{}, err
	}
	for _, l := range logs {
		l()
	}
	return claimed, res, nil
}

// acceptanceExpiryReasons are the errors of acceptance commands expired at
// their deadline, by the state they were in.
var acceptanceExpiryReasons = store.ExpiryReasons{
	Queued:    "not delivered before the deadline: the node was not connected",
	Delivered: "delivered but not started before the deadline",
	Running:   "started but not finished before the deadline",
}

// expiredCheck is an accepting node whose latest acceptance command ran out
// of time (or is missing).
type expiredCheck struct {
	store.AcceptanceCheck
	// expiredIn is the state the command was in when this pass expired it
	// (queued, delivered or running); "" when it had expired before (its
	// CommandError says why) or there is none.
	expiredIn string
}

// outOfTimeReason is the acceptance failure of a node whose last command
// ran out of time after c.Attempts delivered ones: what happened to that
// command, from the state it expired in.
func (a *Acceptance) outOfTimeReason(c expiredCheck) string {
	attempts := fmt.Sprintf("(%d attempts)", c.Attempts)
	if c.Attempts == 1 {
		attempts = "(1 attempt)"
	}
	switch {
	case c.expiredIn == "queued":
		return fmt.Sprintf("diag.nvml was not delivered within %s: the node was not connected %s", a.timeout(), attempts)
	case c.expiredIn == "delivered":
		return fmt.Sprintf("diag.nvml was delivered but did not start within %s %s", a.timeout(), attempts)
	case c.expiredIn == "running":
		return fmt.Sprintf("diag.nvml started but did not finish within %s %s", a.timeout(), attempts)
	case c.CommandState == "expired" && c.CommandError != "":
		return fmt.Sprintf("diag.nvml expired: %s %s", c.CommandError, attempts)
	}
	return fmt.Sprintf("diag.nvml did not finish within %s %s", a.timeout(), attempts)
}

// ResultJSON decodes a stored command result (protojson of a
// gatewayv1.CommandResult): fields it does not know are skipped, so that a
// result a newer gateway or daemon wrote during a rolling upgrade is judged
// by the fields this version knows rather than failed as unreadable.
var ResultJSON = protojson.UnmarshalOptions{DiscardUnknown: true}

// judge evaluates a succeeded acceptance command: it returns the adoption
// of the node, or its failure.
func (a *Acceptance) judge(c store.AcceptanceCheck) (*store.Adoption, *store.AcceptanceFailure) {
	var result gatewayv1.CommandResult
	if len(c.CommandResult) == 0 {
		f := failure(c, "diag.nvml succeeded without reporting an inventory", nil)
		return nil, &f
	}
	if err := ResultJSON.Unmarshal(c.CommandResult, &result); err != nil {
		f := failure(c, "diag.nvml reported an unreadable result", nil)
		return nil, &f
	}
	inv := result.GetInventory()
	if inv == nil {
		f := failure(c, "diag.nvml succeeded without reporting an inventory", nil)
		return nil, &f
	}
	invJSON, err := protojson.Marshal(inv)
	if err != nil {
		f := failure(c, "diag.nvml reported an inventory that cannot be stored", nil)
		return nil, &f
	}
	devices := make([]store.NodeDevice, 0, len(inv.GetGpus()))
	for _, g := range inv.GetGpus() {
		devices = append(devices, store.NodeDevice{NodeID: c.NodeID, Index: g.GetIndex(), UUID: g.GetUuid(),
			Model: g.GetModel(), MemoryBytes: g.GetMemoryBytes(), Healthy: g.GetHealthy()})
	}
	ok, reason := acceptance.Evaluate(acceptance.Rules{GpuModel: c.GPUModel, ExpectGpuCount: int(c.ExpectGPUCount)}, inv)
	if !ok {
		// The GPUs found are recorded, so an operator sees what the
		// machine has; a failed node is never placed on.
		f := failure(c, reason, invJSON)
		f.Devices = devices
		return nil, &f
	}
	spec, err := protojson.Marshal(&gatewayv1.NodeSpec{Labels: map[string]string{LabelPool: c.PoolID, LabelSite: c.SiteID}})
	if err != nil {
		f := failure(c, "could not build the node's spec", invJSON)
		f.Devices = devices
		return nil, &f
	}
	return &store.Adoption{NodeID: c.NodeID, PoolID: c.PoolID, OwnerTenantID: c.OwnerTenantID, Spec: spec,
		Inventory: invJSON, Devices: devices}, nil
}

func failure(c store.AcceptanceCheck, reason string, inventory []byte) store.AcceptanceFailure {
	return store.AcceptanceFailure{NodeID: c.NodeID, PoolID: c.PoolID, OwnerTenantID: c.OwnerTenantID,
		Reason: reason, Inventory: inventory}
}
