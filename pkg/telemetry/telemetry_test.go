package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// TestLogsCarryTraceIDs: with no OTLP endpoint, spans are still made, so a
// record logged in a span's context is JSON with its trace and span ids.
func TestLogsCarryTraceIDs(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	_, shutdown, err := telemetry.Setup(t.Context(), "test")
	require.NoError(t, err)
	t.Cleanup(func() { _ = shutdown(context.Background()) })

	var buf bytes.Buffer
	logger := telemetry.NewLogger(&buf, "test")
	ctx, span := otel.Tracer("test").Start(t.Context(), "op")
	logger.InfoContext(ctx, "hello", telemetry.KeyNodeID, "node_1")
	span.End()

	var rec map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &rec))
	require.Equal(t, span.SpanContext().TraceID().String(), rec["trace_id"])
	require.Equal(t, span.SpanContext().SpanID().String(), rec["span_id"])
	require.Equal(t, "test", rec["service"])
	require.Equal(t, "node_1", rec["node.id"])
}

// TestLoadSettings reads BETTER_COMPUTE_LOG_LEVEL: info when unset, the
// four names in any case, and an error naming the variable otherwise.
func TestLoadSettings(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, value string
		want        slog.Level
		err         string
	}{
		{name: "unset", want: slog.LevelInfo},
		{name: "debug", value: "debug", want: slog.LevelDebug},
		{name: "upper case", value: "WARN", want: slog.LevelWarn},
		{name: "error", value: "error", want: slog.LevelError},
		{name: "unknown", value: "loud", err: `BETTER_COMPUTE_LOG_LEVEL: want debug, info, warn or error, got "loud"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, err := telemetry.LoadSettings(func(k string) string {
				if k == "BETTER_COMPUTE_LOG_LEVEL" {
					return c.value
				}
				return ""
			})
			if c.err != "" {
				require.EqualError(t, err, c.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, c.want, slog.Level(s.LogLevel))
		})
	}
}

// TestNewLoggerLevel: the logger drops what is below the level, and logs
// at info, saying why, when the level is unknown.
func TestNewLoggerLevel(t *testing.T) {
	t.Setenv("BETTER_COMPUTE_LOG_LEVEL", "warn")
	var buf bytes.Buffer
	logger := telemetry.NewLogger(&buf, "test")
	logger.Info("dropped")
	logger.Warn("kept")
	require.NotContains(t, buf.String(), "dropped")
	require.Contains(t, buf.String(), "kept")

	t.Setenv("BETTER_COMPUTE_LOG_LEVEL", "loud")
	buf.Reset()
	logger = telemetry.NewLogger(&buf, "test")
	logger.Info("at info")
	require.Contains(t, buf.String(), `got \"loud\"`)
	require.Contains(t, buf.String(), "at info")
}

// TestTracesEndpoint reads the OTLP variables as OpenTelemetry's exporter
// specification does: the traces endpoint as it is, the base endpoint
// with /v1/traces appended, the former winning.
func TestTracesEndpoint(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, base, traces, want string
	}{
		{name: "neither"},
		{name: "base", base: "http://jaeger:4318", want: "http://jaeger:4318/v1/traces"},
		{name: "base with slash", base: "http://jaeger:4318/", want: "http://jaeger:4318/v1/traces"},
		{name: "traces", traces: "http://collector:4318/custom", want: "http://collector:4318/custom"},
		{name: "both", base: "http://jaeger:4318", traces: "http://collector:4318/custom", want: "http://collector:4318/custom"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got := telemetry.TracesEndpoint(func(k string) string {
				return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": c.base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": c.traces}[k]
			})
			require.Equal(t, c.want, got)
		})
	}
}

// TestNewTracerProviderExports: with an endpoint in the given environment
// (not the process's), the provider's spans reach it at /v1/traces on
// shutdown; without one, nothing is exported.
func TestNewTracerProviderExports(t *testing.T) {
	t.Parallel()
	paths := make(chan string, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		paths <- r.URL.Path
	}))
	defer srv.Close()
	env := func(k string) string {
		if k == "OTEL_EXPORTER_OTLP_ENDPOINT" {
			return srv.URL
		}
		return ""
	}
	tp, exported, err := telemetry.NewTracerProvider(t.Context(), "test", env)
	require.NoError(t, err)
	require.True(t, exported)
	_, span := tp.Tracer("test").Start(t.Context(), "op")
	span.End()
	require.NoError(t, tp.Shutdown(t.Context()))
	require.Equal(t, "/v1/traces", <-paths)

	tp, exported, err = telemetry.NewTracerProvider(t.Context(), "test", func(string) string { return "" })
	require.NoError(t, err)
	require.False(t, exported)
	_, span = tp.Tracer("test").Start(t.Context(), "op")
	require.True(t, span.SpanContext().IsValid(), "spans are made without an exporter")
	span.End()
	require.NoError(t, tp.Shutdown(t.Context()))
	require.Empty(t, paths)
}
