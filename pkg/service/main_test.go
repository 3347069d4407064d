package service_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
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

// probeRunner is a service whose Run fetches a goroutine profile from the
// profiling server at addr and fails unless it got one.
type probeRunner struct{ addr string }

func (probeRunner) Name() string { return "probe" }

func (p probeRunner) Run(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.addr+"/debug/pprof/goroutine?debug=1", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "goroutine profile:") {
		return fmt.Errorf("GET /debug/pprof/goroutine: %s: %.200s", resp.Status, body)
	}
	return nil
}

// TestMainServesProfiles: with BETTER_COMPUTE_PPROF_LISTEN set, a service
// binary serves Go's runtime profiles there while it runs; a busy address
// stops it at start with one line naming the variable; unset, nothing
// listens.
func TestMainServesProfiles(t *testing.T) {
	if os.Getenv("BC_TEST_AS_MAIN") == "1" {
		service.Main("svc", func(mainConfig, service.Deps) (service.Runner, error) {
			return probeRunner{addr: os.Getenv("BC_TEST_PPROF")}, nil
		})
		return
	}
	run := func(env ...string) (string, int) {
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestMainServesProfiles$")
		cmd.Env = append(append(os.Environ(), "BC_TEST_AS_MAIN=1", "BETTER_COMPUTE_LOG_LEVEL=error"), env...)
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return string(out), exit.ExitCode()
		}
		require.NoError(t, err, "output: %s", out)
		return string(out), 0
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())

	out, code := run("BETTER_COMPUTE_PPROF_LISTEN="+addr, "BC_TEST_PPROF="+addr)
	require.Zero(t, code, "output: %s", out)

	// Unset: the service runs, and no profile is served there.
	out, code = run("BC_TEST_PPROF=" + addr)
	require.Equal(t, 1, code, "output: %s", out)
	require.Contains(t, out, "connection refused")

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	out, code = run("BETTER_COMPUTE_PPROF_LISTEN="+busy.Addr().String(), "BC_TEST_PPROF="+addr)
	require.Equal(t, 1, code, "output: %s", out)
	require.Regexp(t, `^svc: BETTER_COMPUTE_PPROF_LISTEN: .*address already in use\n$`, out)
}
