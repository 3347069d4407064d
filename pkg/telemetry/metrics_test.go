package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// TestLoadMetricsSettings reads BETTER_COMPUTE_METRICS_EXPORTER:
// prometheus when unset, the three names in any case, and an error naming
// the variable otherwise (a service refuses to start with it).
func TestLoadMetricsSettings(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, value string
		want        telemetry.Exporter
		err         string
	}{
		{name: "unset", want: telemetry.ExporterPrometheus},
		{name: "none", value: "none", want: telemetry.ExporterNone},
		{name: "upper case", value: "OTLP", want: telemetry.ExporterOTLP},
		{name: "unknown", value: "statsd", err: `BETTER_COMPUTE_METRICS_EXPORTER: want prometheus, otlp or none, got "statsd"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, err := telemetry.LoadMetricsSettings(func(k string) string {
				if k == "BETTER_COMPUTE_METRICS_EXPORTER" {
					return c.value
				}
				return ""
			})
			if c.err != "" {
				require.EqualError(t, err, c.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, c.want, s.MetricsExporter)
		})
	}
}

// TestSetupMetricsRefusesUnknownExporter: the error is one line naming the
// variable, and nothing is set up.
func TestSetupMetricsRefusesUnknownExporter(t *testing.T) {
	m, err := telemetry.SetupMetrics(t.Context(), "test", func(k string) string {
		if k == "BETTER_COMPUTE_METRICS_EXPORTER" {
			return "graphite"
		}
		return ""
	})
	require.Nil(t, m)
	require.EqualError(t, err, `BETTER_COMPUTE_METRICS_EXPORTER: want prometheus, otlp or none, got "graphite"`)
}

// TestOTLPNeedsAnEndpoint: otlp without OTEL_EXPORTER_OTLP_ENDPOINT is
// refused, naming the variable.
func TestOTLPNeedsAnEndpoint(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "")
	_, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterOTLP, "test")
	require.EqualError(t, err, "BETTER_COMPUTE_METRICS_EXPORTER: otlp needs OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
}

// TestPrometheusServesWhatIsRecorded: a counter of the catalog is served
// under its Prometheus name with its label; none serves nothing.
func TestPrometheusServesWhatIsRecorded(t *testing.T) {
	t.Parallel()
	m, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterPrometheus, "test")
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	c := telemetry.Int64Counter(m.Meter("test"), telemetry.CommandsCreated)
	c.Add(t.Context(), 3, telemetry.Attrs(attribute.String(telemetry.LabelKind, "node.reboot")))
	srv := httptest.NewServer(m.Handler)
	t.Cleanup(srv.Close)
	res, err := http.Get(srv.URL) //nolint:noctx // a test's loopback scrape
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.Contains(t, string(body), `bc_commands_created_total{kind="node.reboot",otel_scope_name="test",otel_scope_schema_url="",otel_scope_version=""} 3`)
	require.Contains(t, string(body), `target_info{service_name="test"} 1`)

	none, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterNone, "test")
	require.NoError(t, err)
	require.Nil(t, none.Handler)
}

// TestCounterWithFixedAttributesDoesNotAllocate: a hot path (a gateway's
// heartbeat) adds to a counter with an option slice made once, without an
// allocation per measurement.
func TestCounterWithFixedAttributesDoesNotAllocate(t *testing.T) {
	m, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterPrometheus, "test")
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	c := telemetry.Int64Counter(m.Meter("test"), telemetry.GatewayHeartbeats)
	opts := []metric.AddOption{telemetry.Attrs(attribute.String(telemetry.LabelGateway, "gw-1"))}
	ctx := t.Context()
	c.Add(ctx, 1, opts...)
	require.Zero(t, testing.AllocsPerRun(1000, func() { c.Add(ctx, 1, opts...) }))
}

// TestCatalogNames: every instrument has a unique Prometheus name, a
// description and a service, and only the catalog's instruments can be
// made.
func TestCatalogNames(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for _, in := range telemetry.Catalog() {
		name := in.PrometheusName()
		require.False(t, seen[name], "%s twice", name)
		seen[name] = true
		require.NotEmpty(t, in.Description, in.Name)
		require.NotEmpty(t, in.Services, in.Name)
		if in.Kind == telemetry.Histogram && !in.External {
			require.NotEmpty(t, in.Buckets, in.Name)
		}
	}
	m := telemetry.NoMetrics()
	require.Panics(t, func() {
		telemetry.Int64Counter(m.Meter("test"), telemetry.Instrument{Name: "bc.not.listed", Kind: telemetry.Counter})
	})
	require.Panics(t, func() { telemetry.Int64Counter(m.Meter("test"), telemetry.GatewaySessions) }, "a gauge as a counter")
}

// TestOTLPPushes: with otlp, what is recorded is pushed over OTLP/HTTP to
// OTEL_EXPORTER_OTLP_ENDPOINT (here at shutdown, which flushes), and no
// /metrics is served.
func TestOTLPPushes(t *testing.T) {
	got := make(chan string, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if len(body) > 0 {
			got <- r.Method + " " + r.URL.Path
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", srv.URL)
	m, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterOTLP, "test")
	require.NoError(t, err)
	require.Nil(t, m.Handler)
	telemetry.Int64Counter(m.Meter("test"), telemetry.LivenessSweeps).Add(t.Context(), 1)
	require.NoError(t, m.Shutdown(t.Context()))
	require.Equal(t, "POST /v1/metrics", <-got)
}
