package gateway

import (
	"context"
	"errors"
	"io"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// meterName is the instrumentation scope of the gateway's instruments.
const meterName = "github.com/better-compute/better-compute/services/gateway"

// Reasons a session ended: indexes into closeReasons, the reason label of
// bc.gateway.sessions.closed (closeReason).
const (
	closedByNode = iota
	closedSuperseded
	closedSilent
	closedRevoked
	closedCertExpired
	closedInvalid
	closedShutdown
	closedUnavailable
	closedOther
	closedReasonsLength
)

// closeReasons are the label values of the reasons.
var closeReasons = [closedReasonsLength]string{
	closedByNode: "closed", closedSuperseded: "superseded", closedSilent: "silent", closedRevoked: "revoked",
	closedCertExpired: "cert_expired", closedInvalid: "invalid", closedShutdown: "shutdown",
	closedUnavailable: "unavailable", closedOther: "other",
}

// closeReason is the reason a session ended with err (the Session
// handler's error; nil or EOF when the machine ended it).
func closeReason(err error) int {
	switch {
	case err == nil, errors.Is(err, io.EOF), errors.Is(err, context.Canceled):
		return closedByNode
	case errors.Is(err, errSuperseded):
		return closedSuperseded
	case errors.Is(err, errSilent), errors.Is(err, errNoHello):
		return closedSilent
	case errors.Is(err, errRevoked):
		return closedRevoked
	case errors.Is(err, errShuttingDown):
		return closedShutdown
	case errors.Is(err, errPendingWork), errors.Is(err, errFenced), errors.Is(err, errRecord):
		return closedUnavailable
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnauthenticated: // the certificate's expiry (revocation is errRevoked)
		return closedCertExpired
	case connect.CodeInvalidArgument:
		return closedInvalid
	case connect.CodeCanceled:
		return closedByNode
	}
	return closedOther
}

// metrics are the gateway's instruments (docs/metrics.md), made once in New
// with the attribute sets of this gateway precomputed, so that a heartbeat
// records without an allocation.
type metrics struct {
	opened, closed, heartbeats, pokes, missed metric.Int64Counter
	finished                                  metric.Int64Counter
	commandDuration, activation               metric.Float64Histogram

	gw          metric.MeasurementOption
	gwAdd       []metric.AddOption // gw, passed as is: no slice made per call
	closeAdd    [closedReasonsLength][]metric.AddOption
	commandOpts *telemetry.AttrPairs
}

// newMetrics makes the gateway's instruments on deps' metrics and
// registers the sessions gauge, which reads sessions at each collection.
func newMetrics(m *telemetry.Metrics, gatewayID string, sessions func() int) (*metrics, error) {
	meter := m.Meter(meterName)
	gw := attribute.String(telemetry.LabelGateway, gatewayID)
	x := &metrics{
		opened:          telemetry.Int64Counter(meter, telemetry.GatewaySessionsOpened),
		closed:          telemetry.Int64Counter(meter, telemetry.GatewaySessionsClosed),
		heartbeats:      telemetry.Int64Counter(meter, telemetry.GatewayHeartbeats),
		pokes:           telemetry.Int64Counter(meter, telemetry.GatewayPokes),
		missed:          telemetry.Int64Counter(meter, telemetry.GatewayPokesMissed),
		finished:        telemetry.Int64Counter(meter, telemetry.CommandsFinished),
		commandDuration: telemetry.Float64Histogram(meter, telemetry.CommandDuration),
		activation:      telemetry.Float64Histogram(meter, telemetry.ReservationActivation),
		gw:              telemetry.Attrs(gw),
		gwAdd:           []metric.AddOption{telemetry.Attrs(gw)},
		commandOpts:     telemetry.NewAttrPairs(telemetry.LabelKind, telemetry.LabelState),
	}
	for i, r := range closeReasons {
		x.closeAdd[i] = []metric.AddOption{telemetry.Attrs(gw, attribute.String(telemetry.LabelReason, r))}
	}
	g := telemetry.Int64Gauge(meter, telemetry.GatewaySessions)
	_, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(g, int64(sessions()), x.gw)
		return nil
	}, g)
	return x, err
}

// sessionClosed counts a session that ended with err.
func (m *metrics) sessionClosed(ctx context.Context, err error) {
	m.closed.Add(ctx, 1, m.closeAdd[closeReason(err)]...)
}

// commandFinished counts a command that reached state (terminal) after
// took since it was queued.
func (m *metrics) commandFinished(ctx context.Context, kind, state string, took time.Duration) {
	opt := m.commandOpts.Get(kind, state)
	m.finished.Add(ctx, 1, opt)
	m.commandDuration.Record(ctx, took.Seconds(), opt)
}
