package service_test

import (
	"errors"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/service"
)

// mainConfig is a service configuration with nothing to open.
type mainConfig struct {
	service.Probes `default:"HEALTH_LISTEN=127.0.0.1:0"`
}

// TestMainRefusesUnknownMetricsExporter: a service binary whose
// BETTER_COMPUTE_METRICS_EXPORTER names no exporter exits 1 with one line
// naming the variable, before it builds the service. The binary is this
// test's own, run again as a service's main.
func TestMainRefusesUnknownMetricsExporter(t *testing.T) {
	if os.Getenv("BC_TEST_AS_MAIN") == "1" {
		service.Main("svc", func(mainConfig, service.Deps) (service.Runner, error) {
			return nil, errors.New("the service was built")
		})
		return
	}
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestMainRefusesUnknownMetricsExporter$")
	cmd.Env = append(os.Environ(), "BC_TEST_AS_MAIN=1", "BETTER_COMPUTE_METRICS_EXPORTER=statsd")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "output: %s", out)
	require.Equal(t, 1, exit.ExitCode())
	require.Equal(t, "svc: BETTER_COMPUTE_METRICS_EXPORTER: want prometheus, otlp or none, got \"statsd\"\n", string(out))
}
