package telemetry_test

import (
	"bytes"
	"context"
	"encoding/json"
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
