package gateway

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// The gateway's spans (docs/architecture.md, "Traces"): the poke it
// received, in the trace of the outbox row that carried it (the relay's
// traceparent header), and each command's delivery, in the trace of the
// RunCommand call that queued it (store.SessionCommand.Traceparent), whose
// context the SessionResponse carries on to the daemon. Sessions
// themselves live for hours and have no span.

// tracer makes the gateway's spans (the global provider's).
var tracer = otel.Tracer("github.com/better-compute/better-compute/services/gateway")

// tracePoke records the receipt of a poke whose message carried
// traceparent tp (nothing when it carried none), naming how many of its
// nodes have a session here.
func tracePoke(tp, subject string, woken int) {
	if tp == "" {
		return
	}
	_, span := tracer.Start(telemetry.ContextWithTraceparent(context.Background(), tp), "gateway poke",
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attribute.String("messaging.system", "nats"),
			attribute.String("messaging.destination.name", subject), attribute.Int("bc.sessions.woken", woken)))
	span.End()
}

// startDelivery starts the span of one command's delivery, a child of the
// command's trace context tp (a new trace when tp is empty, so that the
// daemon's span still has a parent here), and returns the traceparent to
// send with it; end records the send's outcome.
func startDelivery(tp, commandID, kind, nodeID string) (traceparent string, end func(error)) {
	ctx, span := tracer.Start(telemetry.ContextWithTraceparent(context.Background(), tp), "gateway deliver command",
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String(telemetry.KeyCommandID, commandID), attribute.String("bc.command.kind", kind),
			attribute.String(telemetry.KeyNodeID, nodeID)))
	return telemetry.Traceparent(ctx), func(err error) {
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}
