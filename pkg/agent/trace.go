package agent

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// tracer makes the machine's spans (the global provider's).
var tracer = otel.Tracer("github.com/better-compute/better-compute/pkg/agent")

// commandSpans are the spans of the commands a machine received with a
// trace context (SessionResponse.traceparent, the gateway's delivery span:
// docs/architecture.md, "Traces"), by command id, from their receipt to
// the update that ends them (succeeded or failed), or to the end of the
// session they came on. Only the driver's goroutine uses them.
type commandSpans map[string]trace.Span

// received starts the span of msg's command when msg is a Command with a
// trace context; a redelivered command already in flight keeps its span.
func (cs commandSpans) received(msg *gatewayv1.SessionResponse, nodeID string) {
	c := msg.GetCommand()
	tp := msg.GetTraceparent()
	if c == nil || tp == "" || cs[c.GetCommandId()] != nil {
		return
	}
	_, span := tracer.Start(telemetry.ContextWithTraceparent(context.Background(), tp), "daemon run command",
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attribute.String(telemetry.KeyCommandID, c.GetCommandId()),
			attribute.String("bc.command.kind", c.GetKind()), attribute.String(telemetry.KeyNodeID, nodeID)))
	cs[c.GetCommandId()] = span
}

// sent ends the span of the command whose terminal update msg is.
func (cs commandSpans) sent(msg *gatewayv1.SessionRequest) {
	u := msg.GetCommandUpdate()
	if u == nil {
		return
	}
	span := cs[u.GetCommandId()]
	if span == nil {
		return
	}
	switch u.GetState() {
	case gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED:
	case gatewayv1.CommandState_COMMAND_STATE_FAILED:
		span.SetStatus(codes.Error, u.GetError())
	default:
		span.AddEvent(u.GetState().String())
		return
	}
	span.End()
	delete(cs, u.GetCommandId())
}

// ended ends every span left when a session ends: their updates, if any,
// go over the next session.
func (cs commandSpans) ended() {
	for id, span := range cs {
		span.SetStatus(codes.Error, "the session ended before the command finished")
		span.End()
		delete(cs, id)
	}
}
