// Package telemetry sets up logs, traces and metrics for a better-compute
// process: log/slog JSON on standard error with the trace and span ids of
// the context, at the level of BETTER_COMPUTE_LOG_LEVEL (Settings),
// OpenTelemetry tracing exported over OTLP/HTTP when
// OTEL_EXPORTER_OTLP_ENDPOINT is set (off otherwise: a no-op provider that
// still propagates W3C trace context), and the OpenTelemetry metrics
// pipeline of BETTER_COMPUTE_METRICS_EXPORTER (MetricsSettings, Metrics:
// Prometheus on GET /metrics by default).
//
// Every metric of the services is an Instrument of Catalog, from which
// docs/metrics.md is generated. To add one: declare it in instruments.go
// (name, kind, unit, bounded labels, the services that export it), add it
// to Catalog, make it once where it is measured (Int64Counter,
// Float64Histogram, Int64Gauge with a callback) on the service's
// Deps.Meter, with fixed attributes made once (Attrs, AttrPairs), and run
// make generate.
package telemetry

import (
	"context"
	"fmt"
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

	"github.com/better-compute/better-compute/pkg/config"
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
	tp, exported, err := NewTracerProvider(ctx, service, os.Getenv)
	if err != nil {
		return nil, nil, err
	}
	if exported {
		logger.Info("tracing exported over OTLP")
	}
	otel.SetTracerProvider(tp)
	return logger, tp.Shutdown, nil
}

// TracesEndpoint is the URL that spans are exported to over OTLP/HTTP, as
// OpenTelemetry's exporter specification reads the environment:
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else
// OTEL_EXPORTER_OTLP_ENDPOINT with /v1/traces appended; "" when neither is
// set (no export).
func TracesEndpoint(getenv func(string) string) string {
	if e := getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"); e != "" {
		return e
	}
	if e := getenv("OTEL_EXPORTER_OTLP_ENDPOINT"); e != "" {
		return strings.TrimSuffix(e, "/") + "/v1/traces"
	}
	return ""
}

// NewTracerProvider returns the tracer provider of a process named service
// (the service.name resource attribute): batching its spans to the OTLP/HTTP
// exporter of TracesEndpoint(getenv) when that is set (exported true), or
// keeping them in process only. The error is the exporter's (a malformed
// endpoint). The caller shuts it down, which flushes the spans. Setup uses
// it for the services; the CLI for its runs.
func NewTracerProvider(ctx context.Context, service string, getenv func(string) string) (tp *sdktrace.TracerProvider, exported bool, err error) {
	opts := []sdktrace.TracerProviderOption{
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(service))),
	}
	if endpoint := TracesEndpoint(getenv); endpoint != "" {
		exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(endpoint))
		if err != nil {
			return nil, false, err
		}
		opts = append(opts, sdktrace.WithBatcher(exp))
		exported = true
	}
	return sdktrace.NewTracerProvider(opts...), exported, nil
}

// Settings are the telemetry settings of every process: the services,
// `better-compute dev` and the fakedaemon (docs/configuration.md).
type Settings struct {
	// LogLevel is the least level logged: debug, info, warn or error.
	LogLevel Level `env:"LOG_LEVEL" default:"info"`
}

// LoadSettings reads Settings from getenv (os.Getenv); its error names the
// variable and says what it wants.
func LoadSettings(getenv func(string) string) (Settings, error) {
	var s Settings
	err := config.Load(&s, getenv)
	return s, err
}

// Level is a log level as BETTER_COMPUTE_LOG_LEVEL names it.
type Level slog.Level

// UnmarshalText reads debug, info, warn or error, in any case.
func (l *Level) UnmarshalText(b []byte) error {
	switch strings.ToLower(string(b)) {
	case "debug":
		*l = Level(slog.LevelDebug)
	case "info":
		*l = Level(slog.LevelInfo)
	case "warn":
		*l = Level(slog.LevelWarn)
	case "error":
		*l = Level(slog.LevelError)
	default:
		return fmt.Errorf("want debug, info, warn or error, got %q", b)
	}
	return nil
}

// NewLogger returns a JSON logger writing to w, at the level of
// Settings.LogLevel (info when BETTER_COMPUTE_LOG_LEVEL is unset; a value
// it does not know is logged as a warning, and info used), with the service
// name and the trace ids of each record's context.
func NewLogger(w io.Writer, service string) *slog.Logger {
	s, err := LoadSettings(os.Getenv)
	if err != nil {
		l := NewLoggerAt(w, service, slog.LevelInfo)
		l.Warn("logging at info", KeyError, err)
		return l
	}
	return NewLoggerAt(w, service, slog.Level(s.LogLevel))
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
