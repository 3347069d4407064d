package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
)

// The W3C trace context carried where no HTTP request does
// (docs/architecture.md, "Traces"): in command and outbox rows, in the
// traceparent header of the NATS messages the outbox relay publishes, and
// in the traceparent field of the gateway's SessionResponse.

// TraceparentHeader is the W3C trace context header (and NATS header) name.
const TraceparentHeader = "traceparent"

var traceContext = propagation.TraceContext{}

// Traceparent returns the W3C traceparent of ctx's span
// ("00-<trace id>-<span id>-<flags>"), or "" when ctx has no valid span.
func Traceparent(ctx context.Context) string {
	c := propagation.MapCarrier{}
	traceContext.Inject(ctx, c)
	return c[TraceparentHeader]
}

// ContextWithTraceparent returns ctx with the remote span context of tp, a
// W3C traceparent, as the parent of the spans started from it; ctx
// unchanged when tp is empty or malformed (it comes from the database or
// the network, and a bad one only loses the link).
func ContextWithTraceparent(ctx context.Context, tp string) context.Context {
	if tp == "" {
		return ctx
	}
	return traceContext.Extract(ctx, propagation.MapCarrier{TraceparentHeader: tp})
}
