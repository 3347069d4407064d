// Package telemetry sets up logs and traces for a better-compute process:
// log/slog JSON on standard error with the trace and span ids of the context,
// and OpenTelemetry tracing exported over OTLP/HTTP when
// OTEL_EXPORTER_OTLP_ENDPOINT is set (off otherwise: a no-op provider that
// still propagates W3C trace context).
package telemetry

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
)

// Attribute keys used in logs across services.
const (
	KeyNodeID        = "node.id"
	KeyPoolID        = "pool.id"
	KeyReservationID = "reservation.id"
	KeyCommandID     = "command.id"
	KeyGatewayID     = "gateway.id"
	KeySessionID     = "session.id"
	KeyTenantID      = "tenant.id"
	KeyError         = "err"
)

// Setup configures the global tracer provider and propagator for service and
// returns its logger and a shutdown function that flushes spans. Spans are
// always made, so every log record written in a traced context carries its
// trace_id and span_id; they are exported over OTLP/HTTP only when
// OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) is set. OpenTelemetry's
// own errors (a failed export) are logged as JSON too.
func Setup(ctx context.Context, service string) (*slog.Logger, func(context.Context) error, error) {
	logger := NewLogger(os.Stderr, service)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		logger.Warn("opentelemetry", KeyError, err)
	}))
	opts := []sdktrace.TracerProviderOption{
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(service))),
	}
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" {
		exp, err := otlptracehttp.New(ctx)
		if err != nil {
			return nil, nil, err
		}
		opts = append(opts, sdktrace.WithBatcher(exp))
		logger.Info("tracing exported over OTLP")
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetTracerProvider(tp)
	return logger, tp.Shutdown, nil
}

// NewLogger returns a JSON logger writing to w, at the level named by
// BC_LOG_LEVEL (debug, info, warn, error; info by default), with the service
// name and the trace ids of each record's context.
func NewLogger(w io.Writer, service string) *slog.Logger {
	var level slog.Level
	switch strings.ToLower(os.Getenv("BC_LOG_LEVEL")) {
	case "debug":
		level = slog.LevelDebug
	case "warn":
		level = slog.LevelWarn
	case "error":
		level = slog.LevelError
	default:
		level = slog.LevelInfo
	}
	return NewLoggerAt(w, service, level)
}

// NewLoggerAt returns a JSON logger writing records of level and above to
// w, with the service name (none when service is empty: a process running
// several services, such as `better-compute dev`, names each with
// Logger.With) and the trace ids of each record's context.
func NewLoggerAt(w io.Writer, service string, level slog.Level) *slog.Logger {
	h := slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})
	l := slog.New(traceHandler{h})
	if service != "" {
		l = l.With("service", service)
	}
	return l
}

// traceHandler adds trace_id and span_id from the record's context.
type traceHandler struct{ slog.Handler }

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(a []slog.Attr) slog.Handler {
	return traceHandler{h.Handler.WithAttrs(a)}
}
func (h traceHandler) WithGroup(n string) slog.Handler { return traceHandler{h.Handler.WithGroup(n)} }

// Discard is a logger that drops everything, for tests.
func Discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
