package cli

import (
	"context"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/otelconnect"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// The CLI's traces (docs/architecture.md, "Traces"): with
// OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) set, a run of an API
// command is one span named after the command ("better-compute reserve"),
// each of its Connect calls a client span under it (otelconnect), whose
// context reaches the API in the traceparent header; the spans are
// exported over OTLP/HTTP (service name better-compute) when the run
// ends. Without the variable the CLI makes no span and sends no trace
// context.

// cliTracing is the tracing of one run; nil when it is off.
type cliTracing struct {
	tp   *sdktrace.TracerProvider
	root trace.Span
	ctx  context.Context // carries root
}

// traceFlushTimeout bounds how long the end of a run waits for the
// spans' export (an unreachable endpoint costs at most this).
const traceFlushTimeout = 3 * time.Second

// tracing returns the run's tracing, starting it (the root span named
// after a.cmdPath) at the first call; nil when no OTLP endpoint is set.
// The error is the exporter's (a malformed endpoint).
func (a *app) tracing() (*cliTracing, error) {
	if a.trace != nil {
		return a.trace, nil
	}
	if telemetry.TracesEndpoint(a.env.Getenv) == "" {
		return nil, nil
	}
	tp, _, err := telemetry.NewTracerProvider(context.Background(), "better-compute", a.env.Getenv)
	if err != nil {
		return nil, err
	}
	name := a.cmdPath
	if name == "" {
		name = "better-compute"
	}
	ctx, root := tp.Tracer("github.com/better-compute/better-compute/cmd/better-compute").Start(context.Background(), name,
		trace.WithSpanKind(trace.SpanKindClient))
	a.trace = &cliTracing{tp: tp, root: root, ctx: ctx}
	return a.trace, nil
}

// interceptors returns the client interceptors of tracing: the root span
// as the parent of each call's, then otelconnect's client spans with the
// W3C trace context header. None when t is nil.
func (t *cliTracing) interceptors() ([]connect.Interceptor, error) {
	if t == nil {
		return nil, nil
	}
	otel, err := otelconnect.NewInterceptor(otelconnect.WithTracerProvider(t.tp),
		otelconnect.WithPropagator(propagation.TraceContext{}), otelconnect.WithoutMetrics())
	if err != nil {
		return nil, err
	}
	parent := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if !trace.SpanFromContext(ctx).SpanContext().IsValid() {
				ctx = trace.ContextWithSpan(ctx, t.root)
			}
			return next(ctx, req)
		}
	})
	return []connect.Interceptor{parent, otel}, nil
}

// end ends the root span and exports the spans, waiting at most
// traceFlushTimeout; nothing when t is nil.
func (t *cliTracing) end() {
	if t == nil {
		return
	}
	t.root.End()
	ctx, cancel := context.WithTimeout(context.Background(), traceFlushTimeout)
	defer cancel()
	_ = t.tp.Shutdown(ctx)
}
