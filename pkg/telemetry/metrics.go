package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"

	"github.com/better-compute/better-compute/pkg/config"
)

// Exporter names where a process's metrics go, as
// BETTER_COMPUTE_METRICS_EXPORTER names it.
type Exporter string

// The exporters.
const (
	// ExporterPrometheus serves the metrics in the Prometheus text format
	// on GET /metrics of the service's probes listener.
	ExporterPrometheus Exporter = "prometheus"
	// ExporterOTLP pushes them over OTLP/HTTP every 15 s to
	// OTEL_EXPORTER_OTLP_ENDPOINT (or _METRICS_ENDPOINT); no /metrics.
	ExporterOTLP Exporter = "otlp"
	// ExporterNone records nothing (a no-op MeterProvider); no /metrics.
	ExporterNone Exporter = "none"
)

// UnmarshalText reads prometheus, otlp or none, in any case.
func (e *Exporter) UnmarshalText(b []byte) error {
	switch v := Exporter(strings.ToLower(string(b))); v {
	case ExporterPrometheus, ExporterOTLP, ExporterNone:
		*e = v
		return nil
	}
	return fmt.Errorf("want prometheus, otlp or none, got %q", b)
}

// MetricsSettings are the metrics settings of every service and of
// `better-compute dev` (docs/configuration.md, docs/metrics.md).
type MetricsSettings struct {
	// MetricsExporter is where the metrics go: prometheus (GET /metrics on
	// the probes listener, beside /healthz and /readyz), otlp (pushed every
	// 15 s over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT, which must then be
	// set) or none. Any other value stops the service at start.
	MetricsExporter Exporter `env:"METRICS_EXPORTER" default:"prometheus"`
}

// LoadMetricsSettings reads MetricsSettings from getenv (os.Getenv); its
// error names the variable and says what it wants.
func LoadMetricsSettings(getenv func(string) string) (MetricsSettings, error) {
	var s MetricsSettings
	err := config.Load(&s, getenv)
	return s, err
}

// Metrics is a process's metrics pipeline: the MeterProvider its
// instruments are made from and, with the prometheus exporter, the handler
// of GET /metrics. The zero value is unusable; NewMetrics makes one.
type Metrics struct {
	// Provider makes the instruments; never nil (a no-op provider with the
	// none exporter).
	Provider metric.MeterProvider
	// Handler serves the Prometheus text format of everything Provider
	// recorded, plus the Go runtime's and the process's own collectors
	// (go_*, process_*); nil unless the exporter is prometheus.
	Handler  http.Handler
	shutdown func(context.Context) error
}

// otlpInterval is how often the otlp exporter pushes.
const otlpInterval = 15 * time.Second

// NewMetrics builds the metrics pipeline of exporter (the zero Exporter is
// prometheus) for service (the
// resource's service.name; Prometheus shows it in target_info): a private
// Prometheus registry per call, so that several stacks in one process (tests)
// never share series. Errors: otlp without an OTLP endpoint in the
// environment (naming BETTER_COMPUTE_METRICS_EXPORTER), or an exporter that
// cannot be built.
func NewMetrics(ctx context.Context, exporter Exporter, service string) (*Metrics, error) {
	res := resource.NewSchemaless(semconv.ServiceName(service))
	switch exporter {
	case ExporterNone:
		return &Metrics{Provider: noop.NewMeterProvider(), shutdown: func(context.Context) error { return nil }}, nil
	case ExporterOTLP:
		if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") == "" {
			return nil, &config.Error{Name: config.Prefix + "METRICS_EXPORTER",
				Err: errors.New("otlp needs OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")}
		}
		exp, err := otlpmetrichttp.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("metrics: otlp: %w", err)
		}
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithResource(res),
			sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp, sdkmetric.WithInterval(otlpInterval))))
		return &Metrics{Provider: mp, shutdown: mp.Shutdown}, nil
	case ExporterPrometheus, "":
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		exp, err := otelprom.New(otelprom.WithRegisterer(reg))
		if err != nil {
			return nil, fmt.Errorf("metrics: prometheus: %w", err)
		}
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithResource(res), sdkmetric.WithReader(exp))
		return &Metrics{Provider: mp, shutdown: mp.Shutdown,
			Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})}, nil
	}
	return nil, &config.Error{Name: config.Prefix + "METRICS_EXPORTER", Err: fmt.Errorf("unknown exporter %q", exporter)}
}

// SetupMetrics reads MetricsSettings from getenv, builds the pipeline
// (NewMetrics) and makes it the global MeterProvider, for instruments made
// through otel.Meter (pkg/iam's). Its error names the variable: a service
// refuses to start with it.
func SetupMetrics(ctx context.Context, service string, getenv func(string) string) (*Metrics, error) {
	s, err := LoadMetricsSettings(getenv)
	if err != nil {
		return nil, err
	}
	m, err := NewMetrics(ctx, s.MetricsExporter, service)
	if err != nil {
		return nil, err
	}
	otel.SetMeterProvider(m.Provider)
	return m, nil
}

// NoMetrics returns a pipeline that records nothing (the none exporter),
// for a process that exports no metrics of its own (the node agent).
func NoMetrics() *Metrics {
	return &Metrics{Provider: noop.NewMeterProvider(), shutdown: func(context.Context) error { return nil }}
}

// Shutdown flushes (otlp) and stops the pipeline.
func (m *Metrics) Shutdown(ctx context.Context) error {
	if m == nil || m.shutdown == nil {
		return nil
	}
	return m.shutdown(ctx)
}

// Meter returns the meter named name (an instrumentation scope: the
// package making the instruments, shown as otel_scope_name on every series)
// of m, or of the global MeterProvider when m is nil.
func (m *Metrics) Meter(name string) metric.Meter {
	if m == nil {
		return otel.GetMeterProvider().Meter(name)
	}
	return m.Provider.Meter(name)
}

// MeterProvider returns m's provider, or the global one when m is nil.
func (m *Metrics) MeterProvider() metric.MeterProvider {
	if m == nil {
		return otel.GetMeterProvider()
	}
	return m.Provider
}
