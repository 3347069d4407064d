package controllers

import (
	"context"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// meterName is the instrumentation scope of the controllers' instruments.
const meterName = "github.com/better-compute/better-compute/services/controllers"

// statsTimeout bounds the read of the fleet's figures at one collection.
const statsTimeout = 2 * time.Second

// The states the gauges always report, 0 when none: a state that empties
// then reads 0 rather than vanishing.
var (
	provisionStates   = []string{store.NodeJoining, store.NodeAccepting, store.NodeAdopted, store.NodeAcceptanceFailed}
	liveReservations  = []string{store.ReservationPending, store.ReservationBinding, store.ReservationActive}
	commandKinds      = []string{store.CommandDiagNVML, store.CommandInventoryRefresh, store.CommandLogsCollect, store.CommandNodeReboot}
	openCommandStates = []string{"queued", "delivered", "running"}
	reachabilityNames = []string{"true", "false"}
)

// registerGauges registers the controllers' observable gauges on meter
// (docs/metrics.md): bc.lease.held of each of this replica's leases, and
// the figures read from the database (store.FleetStatsAt) — nodes, GPUs
// per pool, live reservations, open commands, the outbox backlog — which
// only the replica holding stats (the liveness lease) reads, so that the
// fleet is counted once however many replicas run.
func registerGauges(meter metric.Meter, db *store.DB, leases []*lease.Lease, stats *lease.Lease) error {
	held := telemetry.Int64Gauge(meter, telemetry.LeaseHeld)
	leaseAttrs := make([]metric.ObserveOption, len(leases))
	for i, l := range leases {
		leaseAttrs[i] = telemetry.Attrs(attribute.String(telemetry.LabelLease, l.Name))
	}
	nodes := telemetry.Int64Gauge(meter, telemetry.Nodes)
	gpus := telemetry.Int64Gauge(meter, telemetry.GPUs)
	reservations := telemetry.Int64Gauge(meter, telemetry.Reservations)
	commands := telemetry.Int64Gauge(meter, telemetry.Commands)
	backlog := telemetry.Int64Gauge(meter, telemetry.OutboxBacklog)
	oldest := telemetry.Float64Gauge(meter, telemetry.OutboxOldest)
	nodeAttrs := telemetry.NewAttrPairs(telemetry.LabelProvision, telemetry.LabelReachable)
	commandAttrs := telemetry.NewAttrPairs(telemetry.LabelKind, telemetry.LabelState)
	resAttrs := make([]metric.ObserveOption, len(liveReservations))
	for i, st := range liveReservations {
		resAttrs[i] = telemetry.Attrs(attribute.String(telemetry.LabelState, st))
	}
	_, err := meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		for i, l := range leases {
			o.ObserveInt64(held, b2i(l.Held()), leaseAttrs[i])
		}
		if !stats.Held() {
			return nil
		}
		ctx, cancel := context.WithTimeout(ctx, statsTimeout)
		defer cancel()
		s, err := store.FleetStatsAt(ctx, db.Pool, db.Now())
		if err != nil {
			return err // the SDK reports it through otel's error handler (logged)
		}
		seen := map[[2]string]bool{}
		for _, n := range s.Nodes {
			r := strconv.FormatBool(n.Reachable)
			seen[[2]string{n.ProvisionState, r}] = true
			o.ObserveInt64(nodes, n.N, nodeAttrs.Get(n.ProvisionState, r))
		}
		for _, st := range provisionStates {
			for _, r := range reachabilityNames {
				if !seen[[2]string{st, r}] {
					o.ObserveInt64(nodes, 0, nodeAttrs.Get(st, r))
				}
			}
		}
		for _, g := range s.GPUs {
			// Pools are few and made by operators; these sets are not kept.
			o.ObserveInt64(gpus, g.N, metric.WithAttributes(attribute.String(telemetry.LabelPoolID, g.PoolID),
				attribute.String(telemetry.LabelPoolName, g.PoolName), attribute.String(telemetry.LabelState, g.State)))
		}
		for i, st := range liveReservations {
			o.ObserveInt64(reservations, s.Reservations[st], resAttrs[i])
		}
		open := map[[2]string]int64{}
		for _, c := range s.Commands {
			open[[2]string{c.Kind, c.State}] = c.N
		}
		for _, k := range commandKinds {
			for _, st := range openCommandStates {
				o.ObserveInt64(commands, open[[2]string{k, st}], commandAttrs.Get(k, st))
			}
		}
		o.ObserveInt64(backlog, s.OutboxRows)
		o.ObserveFloat64(oldest, s.OutboxAge.Seconds())
		return nil
	}, held, nodes, gpus, reservations, commands, backlog, oldest)
	return err
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// commandMetrics are the instruments of the commands the controllers end
// (CommandExpiry): bc.commands.finished and bc.commands.duration.
type commandMetrics struct {
	once     sync.Once
	finished metric.Int64Counter
	duration metric.Float64Histogram
	attrs    *telemetry.AttrPairs
}

func (m *commandMetrics) init(metrics *telemetry.Metrics) *commandMetrics {
	m.once.Do(func() {
		meter := metrics.Meter(meterName)
		m.finished = telemetry.Int64Counter(meter, telemetry.CommandsFinished)
		m.duration = telemetry.Float64Histogram(meter, telemetry.CommandDuration)
		m.attrs = telemetry.NewAttrPairs(telemetry.LabelKind, telemetry.LabelState)
	})
	return m
}

// ended counts c, which ended in state at now.
func (m *commandMetrics) ended(ctx context.Context, c store.Command, state string, now time.Time) {
	opt := m.attrs.Get(c.Kind, state)
	m.finished.Add(ctx, 1, opt)
	m.duration.Record(ctx, now.Sub(c.CreatedAt).Seconds(), opt)
}

// livenessMetrics are the liveness sweeper's instruments.
type livenessMetrics struct {
	once                sync.Once
	sweeps, unreachable metric.Int64Counter
}

func (m *livenessMetrics) init(metrics *telemetry.Metrics) *livenessMetrics {
	m.once.Do(func() {
		meter := metrics.Meter(meterName)
		m.sweeps = telemetry.Int64Counter(meter, telemetry.LivenessSweeps)
		m.unreachable = telemetry.Int64Counter(meter, telemetry.LivenessUnreachable)
	})
	return m
}
