package telemetry

import (
	"fmt"
	"slices"
	"sync"

	"github.com/prometheus/otlptranslator"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Kind is the kind of an instrument, as Prometheus shows it.
type Kind string

// The kinds of instrument.
const (
	// Counter only grows (Prometheus counter, name ending _total).
	Counter Kind = "counter"
	// Gauge is a value read at each collection or moved up and down
	// (Prometheus gauge).
	Gauge Kind = "gauge"
	// Histogram is a distribution in buckets (Prometheus histogram:
	// _bucket, _sum, _count).
	Histogram Kind = "histogram"
)

// Instrument describes one metric of better-compute: what Catalog lists,
// docs/metrics.md shows (cmd/better-compute/internal/genmetrics) and the
// services make their instruments from (Int64Counter and the others take
// one), so that the reference is the code's own list.
type Instrument struct {
	// Name is the OpenTelemetry name ("bc.commands.created"); Prometheus
	// shows it with dots as underscores and the unit and _total suffixes.
	Name string
	// Kind is its kind.
	Kind Kind
	// Unit is its UCUM unit ("s", "{command}").
	Unit string
	// Description is its help text.
	Description string
	// Labels are its attribute keys, each with a bounded set of values.
	Labels []string
	// Services are the services that export it.
	Services []string
	// Buckets are a histogram's bucket boundaries, in Unit.
	Buckets []float64
	// External is set for instruments a library makes (otelconnect,
	// otelpgx): listed here for the reference only.
	External bool
}

// Services as Instrument.Services names them.
const (
	svcAPI         = "api"
	svcJoin        = "joinservice"
	svcGateway     = "gateway"
	svcScheduler   = "scheduler"
	svcControllers = "controllers"
)

// Label keys of the instruments. None holds a node, reservation, command,
// token or tenant id: their values are bounded by the code (states, kinds,
// reasons) or by operator action (pools, gateways, leases).
const (
	LabelState      = "state"
	LabelKind       = "kind"
	LabelReason     = "reason"
	LabelOutcome    = "outcome"
	LabelLease      = "lease"
	LabelGateway    = "gateway.id"
	LabelPoolID     = "pool.id"
	LabelPoolName   = "pool.name"
	LabelProvision  = "provision_state"
	LabelReachable  = "reachable"
	LabelSubject    = "subject"
	LabelCause      = "cause"
	LabelDBPool     = "db.client.connection.pool.name"
	LabelRPCMethod  = "rpc.method"
	LabelRPCStatus  = "rpc.response.status_code"
	LabelRPCSystem  = "rpc.system.name"
	LabelServerAddr = "server.address"
	LabelServerPort = "server.port"
	LabelDBSystem   = "db.system.name"
	labelAuthReason = "reason"
)

// latencyBuckets are the bounds, in seconds, of the latency histograms of
// work that crosses services (a command's round trip, a reservation's
// binding): 10 ms to 10 min.
var latencyBuckets = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// The instruments (Catalog lists them all).
var (
	// RPCServerDuration is otelconnect's histogram of every Connect call a
	// service serves (the gateway's Session streams are not measured).
	RPCServerDuration = Instrument{Name: "rpc.server.call.duration", Kind: Histogram, Unit: "s",
		Description: "Duration of the Connect calls served, by procedure and status code (otelconnect; the gateway's sessions and tunnels are long-lived streams and not measured).",
		Labels:      []string{LabelRPCSystem, LabelRPCMethod, LabelRPCStatus},
		Services:    []string{svcAPI, svcJoin}, External: true}
	// RPCClientDuration is otelconnect's histogram of the calls the API makes
	// to gateways (tunnels).
	RPCClientDuration = Instrument{Name: "rpc.client.call.duration", Kind: Histogram, Unit: "s",
		Description: "Duration of the Connect calls made to gateways (tunnels), by procedure, status code and gateway address (otelconnect).",
		Labels:      []string{LabelRPCSystem, LabelRPCMethod, LabelRPCStatus, LabelServerAddr, LabelServerPort},
		Services:    []string{svcAPI}, External: true}
	// AuthFailures counts API calls refused for their credential (pkg/iam).
	AuthFailures = Instrument{Name: "bc.auth.failures", Kind: Counter, Unit: "{call}",
		Description: "API calls refused for their credential, by reason: missing, malformed, unknown, revoked, expired, throttled.",
		Labels:      []string{labelAuthReason}, Services: []string{svcAPI}}

	// CommandsCreated counts commands queued by RunCommand.
	CommandsCreated = Instrument{Name: "bc.commands.created", Kind: Counter, Unit: "{command}",
		Description: "Commands queued by RunCommand (a retried call that found its command counts none), by kind.",
		Labels:      []string{LabelKind}, Services: []string{svcAPI}}
	// CommandsFinished counts commands that reached a terminal state.
	CommandsFinished = Instrument{Name: "bc.commands.finished", Kind: Counter, Unit: "{command}",
		Description: "Commands that reached a terminal state (succeeded, failed, expired), by kind and state: the gateway counts the daemons' reports, the controllers the user commands they expired (an acceptance check that the acceptance reconciler expires, to retry it, is not counted).",
		Labels:      []string{LabelKind, LabelState}, Services: []string{svcGateway, svcControllers}}
	// CommandDuration is the queued→terminal latency of commands.
	CommandDuration = Instrument{Name: "bc.commands.duration", Kind: Histogram, Unit: "s",
		Description: "Time from a command's queueing to its terminal state, by kind and state (as bc.commands.finished counts them).",
		Labels:      []string{LabelKind, LabelState}, Services: []string{svcGateway, svcControllers}, Buckets: latencyBuckets}
	// Commands is the number of open commands by kind and state.
	Commands = Instrument{Name: "bc.commands.open", Kind: Gauge, Unit: "{command}",
		Description: "Commands not yet finished (queued, delivered, running), by kind and state (0 for each pair without any), read from the database (finished ones: bc.commands.finished).",
		Labels:      []string{LabelKind, LabelState}, Services: []string{svcControllers}}

	// Reservations is the number of live reservations by state.
	Reservations = Instrument{Name: "bc.reservations", Kind: Gauge, Unit: "{reservation}",
		Description: "Reservations not yet ended (pending, binding, active), by state (0 for a state without any), read from the database.",
		Labels:      []string{LabelState}, Services: []string{svcControllers}}
	// ReservationActivation is the created→active latency of reservations.
	ReservationActivation = Instrument{Name: "bc.reservations.activation", Kind: Histogram, Unit: "s",
		Description: "Time from a reservation's creation to its machine's AllocationBound (active), including any wait for its start time.",
		Services:    []string{svcGateway}, Buckets: latencyBuckets}
	// ReservationsPlaced counts the reservations the scheduler placed.
	ReservationsPlaced = Instrument{Name: "bc.scheduler.placements", Kind: Counter, Unit: "{reservation}",
		Description: "Reservations the scheduler placed on a node (binding).",
		Services:    []string{svcScheduler}}

	// Nodes is the number of nodes by provision state and reachability.
	Nodes = Instrument{Name: "bc.nodes", Kind: Gauge, Unit: "{node}",
		Description: "Nodes not revoked, by provision state (joining, accepting, adopted, acceptance_failed) and reachability (0 for each pair without any), read from the database.",
		Labels:      []string{LabelProvision, LabelReachable}, Services: []string{svcControllers}}
	// GPUs is the number of GPUs of adopted nodes per pool, free or booked.
	GPUs = Instrument{Name: "bc.gpus", Kind: Gauge, Unit: "{gpu}",
		Description: "GPUs of the adopted, unrevoked nodes of each pool, by state: booked (a booking holds it now) or free, read from the database.",
		Labels:      []string{LabelPoolID, LabelPoolName, LabelState}, Services: []string{svcControllers}}

	// OutboxBacklog is the number of outbox rows waiting for the relay.
	OutboxBacklog = Instrument{Name: "bc.outbox.backlog", Kind: Gauge, Unit: "{row}",
		Description: "Outbox rows not yet published, read from the database.",
		Services:    []string{svcControllers}}
	// OutboxOldest is the age of the oldest outbox row.
	OutboxOldest = Instrument{Name: "bc.outbox.oldest_age", Kind: Gauge, Unit: "s",
		Description: "Age of the oldest outbox row not yet published (0 when none), read from the database.",
		Services:    []string{svcControllers}}
	// OutboxPublished counts the messages the relay published, by subject
	// family.
	OutboxPublished = Instrument{Name: "bc.outbox.published", Kind: Counter, Unit: "{message}",
		Description: "Messages the outbox relay published to NATS, by subject family: poke.gw, poke.controllers, poke.scheduler (the pokes sent), events, iam, other.",
		Labels:      []string{LabelSubject}, Services: []string{svcControllers}}
	// OutboxPublishFailures counts relay passes that failed and rolled back.
	OutboxPublishFailures = Instrument{Name: "bc.outbox.publish_failures", Kind: Counter, Unit: "{pass}",
		Description: "Outbox relay passes that failed (NATS or the database unreachable) and were rolled back, to be retried.",
		Services:    []string{svcControllers}}
	// OutboxDeadLetters counts rows set aside (pkg/outbox).
	OutboxDeadLetters = Instrument{Name: "bc.outbox.dead_letters", Kind: Counter, Unit: "{row}",
		Description: "Outbox rows set aside because NATS can never take them, by cause: max_payload, bad_subject.",
		Labels:      []string{LabelCause}, Services: []string{svcControllers}}

	// GatewaySessions is the number of sessions a gateway holds.
	GatewaySessions = Instrument{Name: "bc.gateway.sessions", Kind: Gauge, Unit: "{session}",
		Description: "Live node sessions this gateway holds.",
		Labels:      []string{LabelGateway}, Services: []string{svcGateway}}
	// GatewaySessionsOpened counts sessions opened (Welcome sent).
	GatewaySessionsOpened = Instrument{Name: "bc.gateway.sessions.opened", Kind: Counter, Unit: "{session}",
		Description: "Node sessions this gateway opened (Hello accepted).",
		Labels:      []string{LabelGateway}, Services: []string{svcGateway}}
	// GatewaySessionsClosed counts sessions ended, by reason.
	GatewaySessionsClosed = Instrument{Name: "bc.gateway.sessions.closed", Kind: Counter, Unit: "{session}",
		Description: "Node sessions this gateway ended, by reason: closed (the machine ended it), superseded, silent, revoked, cert_expired, invalid, shutdown, unavailable, other.",
		Labels:      []string{LabelGateway, LabelReason}, Services: []string{svcGateway}}
	// GatewayHeartbeats counts heartbeats received.
	GatewayHeartbeats = Instrument{Name: "bc.gateway.heartbeats", Kind: Counter, Unit: "{heartbeat}",
		Description: "Heartbeats received from machines (rate() of it: heartbeats per second).",
		Labels:      []string{LabelGateway}, Services: []string{svcGateway}}
	// GatewayPokes counts pokes received.
	GatewayPokes = Instrument{Name: "bc.gateway.pokes", Kind: Counter, Unit: "{poke}",
		Description: "Pokes (bc.poke.gw.<gateway>) this gateway received.",
		Labels:      []string{LabelGateway}, Services: []string{svcGateway}}
	// GatewayPokesMissed counts sessions the resync found with work.
	GatewayPokesMissed = Instrument{Name: "bc.gateway.pokes.missed", Kind: Counter, Unit: "{session}",
		Description: "Sessions the periodic resync found with work (queued commands, a newer spec) while idle: work whose poke was lost, or is still on its way (an upper bound of the pokes missed).",
		Labels:      []string{LabelGateway}, Services: []string{svcGateway}}

	// LivenessSweeps counts liveness sweeps.
	LivenessSweeps = Instrument{Name: "bc.liveness.sweeps", Kind: Counter, Unit: "{sweep}",
		Description: "Liveness sweeps run (by the replica holding the liveness lease).",
		Services:    []string{svcControllers}}
	// LivenessUnreachable counts nodes marked unreachable.
	LivenessUnreachable = Instrument{Name: "bc.liveness.unreachable", Kind: Counter, Unit: "{node}",
		Description: "Nodes the liveness sweeper marked unreachable.",
		Services:    []string{svcControllers}}
	// LeaseHeld is 1 per lease this replica holds, 0 per lease it waits for.
	LeaseHeld = Instrument{Name: "bc.lease.held", Kind: Gauge, Unit: "{lease}",
		Description: "1 for each lease (role) this replica holds, 0 for each it stands by for: the scheduler's, and each reconciler's of the controllers.",
		Labels:      []string{LabelLease}, Services: []string{svcScheduler, svcControllers}}

	// JoinAttempts counts Join calls by outcome.
	JoinAttempts = Instrument{Name: "bc.join.attempts", Kind: Counter, Unit: "{call}",
		Description: "Join calls by outcome: joined, rejoined (a retry of a joined key), or the Connect code of the refusal (invalid_argument, permission_denied, resource_exhausted, …).",
		Labels:      []string{LabelOutcome}, Services: []string{svcJoin}}

	// DBPoolAcquired and the other pgxpool.* are otelpgx's pool statistics
	// (pgxpool.Stat) of each service's two pools: main and generic.
	DBPoolAcquired = dbPool("pgxpool.acquired_connections", Gauge, "", "Connections of the pool in use.")
	// DBPoolIdle is the idle connections of a pool.
	DBPoolIdle = dbPool("pgxpool.idle_connections", Gauge, "", "Connections of the pool idle.")
	// DBPoolTotal is all the connections of a pool.
	DBPoolTotal = dbPool("pgxpool.total_connections", Gauge, "", "Connections of the pool open (in use, idle or being made).")
	// DBPoolMax is the size limit of a pool.
	DBPoolMax = dbPool("pgxpool.max_connections", Gauge, "", "Most connections the pool opens.")
	// DBPoolConstructing is the connections being opened.
	DBPoolConstructing = dbPool("pgxpool.constructing_connections", Gauge, "", "Connections of the pool being opened.")
	// DBPoolAcquires counts acquires.
	DBPoolAcquires = dbPool("pgxpool.acquires", Counter, "", "Connections acquired from the pool.")
	// DBPoolAcquireDuration is the total time spent acquiring.
	DBPoolAcquireDuration = dbPool("pgxpool.acquire_duration", Counter, "ns", "Time spent acquiring connections, in all.")
	// DBPoolEmptyAcquires counts acquires that waited.
	DBPoolEmptyAcquires = dbPool("pgxpool.empty_acquire", Counter, "", "Acquires that waited for a connection (the pool was empty).")
	// DBPoolEmptyAcquireWait is the total time acquires waited.
	DBPoolEmptyAcquireWait = dbPool("pgxpool.empty_acquire_wait_time", Counter, "ns", "Time acquires waited for a connection, in all.")
	// DBPoolCanceledAcquires counts acquires canceled.
	DBPoolCanceledAcquires = dbPool("pgxpool.canceled_acquires", Counter, "", "Acquires canceled by their context.")
	// DBPoolNewConnections counts connections opened.
	DBPoolNewConnections = dbPool("pgxpool.new_connections", Counter, "", "Connections the pool opened.")
	// DBPoolIdleDestroys counts connections closed for idleness.
	DBPoolIdleDestroys = dbPool("pgxpool.max_idle_destroys", Counter, "", "Connections closed for being idle too long.")
	// DBPoolLifetimeDestroys counts connections closed for age.
	DBPoolLifetimeDestroys = dbPool("pgxpool.max_lifetime_destroys", Counter, "", "Connections closed for their age.")
)

func dbPool(name string, k Kind, unit, desc string) Instrument {
	return Instrument{Name: name, Kind: k, Unit: unit, Description: desc + " (otelpgx, pgxpool.Stat)",
		Labels:   []string{LabelDBSystem, LabelDBPool},
		Services: []string{svcAPI, svcJoin, svcGateway, svcScheduler, svcControllers}, External: true}
}

// Catalog returns every instrument, in the order docs/metrics.md lists
// them.
func Catalog() []Instrument {
	return []Instrument{
		RPCServerDuration, RPCClientDuration, AuthFailures,
		CommandsCreated, CommandsFinished, CommandDuration, Commands,
		Reservations, ReservationActivation, ReservationsPlaced,
		Nodes, GPUs,
		OutboxBacklog, OutboxOldest, OutboxPublished, OutboxPublishFailures, OutboxDeadLetters,
		GatewaySessions, GatewaySessionsOpened, GatewaySessionsClosed, GatewayHeartbeats, GatewayPokes, GatewayPokesMissed,
		LivenessSweeps, LivenessUnreachable, LeaseHeld,
		JoinAttempts,
		DBPoolAcquired, DBPoolIdle, DBPoolTotal, DBPoolMax, DBPoolConstructing, DBPoolAcquires, DBPoolAcquireDuration,
		DBPoolEmptyAcquires, DBPoolEmptyAcquireWait, DBPoolCanceledAcquires, DBPoolNewConnections, DBPoolIdleDestroys,
		DBPoolLifetimeDestroys,
	}
}

// check panics when in is not of kind k: an instrument made from the wrong
// entry is a programming error that the first test run meets.
func (in Instrument) check(k Kind) {
	if in.Kind != k || in.External || !slices.ContainsFunc(Catalog(), func(c Instrument) bool { return c.Name == in.Name }) {
		panic(fmt.Sprintf("telemetry: %s is not a %s of the catalog", in.Name, k))
	}
}

// Int64Counter makes in, a Counter of the catalog, on m.
func Int64Counter(m metric.Meter, in Instrument) metric.Int64Counter {
	in.check(Counter)
	c, err := m.Int64Counter(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description))
	if err != nil {
		panic(err) // only for an invalid name, which the catalog's test checks
	}
	return c
}

// Float64Histogram makes in, a Histogram of the catalog, on m, with its
// buckets.
func Float64Histogram(m metric.Meter, in Instrument) metric.Float64Histogram {
	in.check(Histogram)
	h, err := m.Float64Histogram(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description),
		metric.WithExplicitBucketBoundaries(in.Buckets...))
	if err != nil {
		panic(err)
	}
	return h
}

// Int64Gauge makes in, a Gauge of the catalog, on m: an observable gauge
// read by callback at each collection (m.RegisterCallback).
func Int64Gauge(m metric.Meter, in Instrument) metric.Int64ObservableGauge {
	in.check(Gauge)
	g, err := m.Int64ObservableGauge(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description))
	if err != nil {
		panic(err)
	}
	return g
}

// Float64Gauge is Int64Gauge for a float value.
func Float64Gauge(m metric.Meter, in Instrument) metric.Float64ObservableGauge {
	in.check(Gauge)
	g, err := m.Float64ObservableGauge(in.Name, metric.WithUnit(in.Unit), metric.WithDescription(in.Description))
	if err != nil {
		panic(err)
	}
	return g
}

// Attrs returns the measurement option of a fixed attribute set, made
// once so that a hot path records without building it again (and without
// an allocation per measurement).
func Attrs(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(kv...))
}

// AttrPairs keeps the measurement option of each pair of values of two
// attributes (a command's kind and state) once made, for instruments
// whose attributes are bounded but not known in advance.
type AttrPairs struct {
	k1, k2 string
	mu     sync.Mutex
	m      map[[2]string]metric.MeasurementOption
}

// NewAttrPairs returns an empty AttrPairs of the keys k1 and k2; with k2
// empty it keeps one attribute, k1 (Get's v2 is then ignored).
func NewAttrPairs(k1, k2 string) *AttrPairs {
	return &AttrPairs{k1: k1, k2: k2, m: map[[2]string]metric.MeasurementOption{}}
}

// Get returns the option of {k1: v1, k2: v2}.
func (p *AttrPairs) Get(v1, v2 string) metric.MeasurementOption {
	p.mu.Lock()
	defer p.mu.Unlock()
	key := [2]string{v1, v2}
	o, ok := p.m[key]
	if !ok {
		if p.k2 == "" {
			o = Attrs(attribute.String(p.k1, v1))
		} else {
			o = Attrs(attribute.String(p.k1, v1), attribute.String(p.k2, v2))
		}
		p.m[key] = o
	}
	return o
}

// PrometheusName is the name the prometheus exporter gives in's series
// (dots as underscores, the unit's suffix, _total for a counter), as the
// exporter's own translator (otlptranslator, UnderscoreEscapingWithSuffixes)
// builds it; a histogram's series add _bucket, _sum and _count.
func (in Instrument) PrometheusName() string {
	var t otlptranslator.MetricType = otlptranslator.MetricTypeGauge
	switch in.Kind {
	case Counter:
		t = otlptranslator.MetricTypeMonotonicCounter
	case Histogram:
		t = otlptranslator.MetricTypeHistogram
	}
	namer := otlptranslator.NewMetricNamer("", otlptranslator.UnderscoreEscapingWithSuffixes)
	name, err := namer.Build(otlptranslator.Metric{Name: in.Name, Unit: in.Unit, Type: t})
	if err != nil {
		panic(fmt.Sprintf("telemetry: %s: %v", in.Name, err)) // the catalog's names are constant and valid
	}
	return name
}

// PrometheusLabels are in's label names as the exporter writes them.
func (in Instrument) PrometheusLabels() []string {
	namer := otlptranslator.LabelNamer{}
	out := make([]string, len(in.Labels))
	for i, l := range in.Labels {
		n, err := namer.Build(l)
		if err != nil {
			panic(fmt.Sprintf("telemetry: %s: label %s: %v", in.Name, l, err))
		}
		out[i] = n
	}
	return out
}
