package compose_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// prometheusImage is compose.yaml's default Prometheus image (scripts/images.sh
// observability builds it).
func prometheusImage() string {
	if v := os.Getenv("BETTER_COMPUTE_PROMETHEUS_IMAGE"); v != "" {
		return v
	}
	return "better-compute/prometheus:0.316.0"
}

// TestObservabilityRules: deploy/observability's Prometheus configuration
// and rules pass `promtool check config` (which checks the rules files it
// names too) with the promtool of the profile's image, and every metric
// the rules name is in the catalog (docs/metrics.md) under its Prometheus
// name, so that a renamed metric cannot leave an alert that never fires.
func TestObservabilityRules(t *testing.T) {
	root := repoRoot(t)
	dir := filepath.Join(root, "deploy", "observability")
	out, err := exec.CommandContext(t.Context(), "docker", "run", "--rm", "--network", "none",
		"-v", dir+"/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
		"-v", dir+"/rules.yml:/etc/prometheus/rules.yml:ro",
		"--entrypoint", "/promtool", prometheusImage(),
		"check", "config", "/etc/prometheus/prometheus.yml").CombinedOutput()
	require.NoError(t, err, "promtool check config (image from scripts/images.sh observability):\n%s", out)
	require.Contains(t, string(out), "SUCCESS: 1 rule files found", string(out))

	known := map[string]bool{}
	for _, in := range telemetry.Catalog() {
		name := in.PrometheusName()
		known[name] = true
		if in.Kind == telemetry.Histogram {
			for _, sfx := range []string{"_bucket", "_sum", "_count"} {
				known[name+sfx] = true
			}
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "rules.yml"))
	require.NoError(t, err)
	var exprs []string
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "expr:"); ok {
			exprs = append(exprs, v)
		}
	}
	require.NotEmpty(t, exprs)
	// The metric names of better-compute's namespaces; recording rules'
	// names (bc:…) have a colon and are not matched.
	metric := regexp.MustCompile(`\b(?:bc|rpc|pgxpool)_[a-z0-9_]+\b`)
	// Label names: in matchers ({…}) and grouping clauses (by/on/without (…)).
	labels := regexp.MustCompile(`\{[^}]*\}|\b(?:by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)`)
	var unknown []string
	named := map[string]bool{}
	for _, e := range exprs {
		for _, m := range metric.FindAllString(labels.ReplaceAllString(e, " "), -1) {
			named[m] = true
			if !known[m] {
				unknown = append(unknown, m)
			}
		}
	}
	require.Empty(t, unknown, "metrics the rules name that the catalog does not have")
	// Each failure mode of the issue has its rule.
	for _, m := range []string{"bc_outbox_oldest_age_seconds", "bc_outbox_publish_failures_total", "bc_gateway_sessions", "bc_reservations"} {
		require.True(t, named[m], "no rule reads %s", m)
	}
}

// TestComposeObservability brings the stack up with the observability
// profile (as `make up OBS=1` does), makes a reservation and runs a
// command through the CLI, then asks Prometheus's HTTP API for the series
// of the work done (commands finished, RPC durations, sessions per
// gateway, the reservation's activation, every scrape target up) and
// Jaeger's for one trace that crosses the CLI, the API, the outbox relay,
// the gateway and the daemon.
func TestComposeObservability(t *testing.T) {
	promPort, jaegerPort, otlpPort := freePort(t), freePort(t), freePort(t)
	s := newProject(t, "bceobs", nil,
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318",
		"BETTER_COMPUTE_PROMETHEUS_PORT="+strconv.Itoa(promPort),
		"BETTER_COMPUTE_JAEGER_PORT="+strconv.Itoa(jaegerPort),
		"BETTER_COMPUTE_OTLP_PORT="+strconv.Itoa(otlpPort),
		// The CLI runs on the host: Jaeger's published OTLP port (the
		// traces variable wins over OTEL_EXPORTER_OTLP_ENDPOINT, which
		// compose hands the containers).
		fmt.Sprintf("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:%d/v1/traces", otlpPort),
	)
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := s.run(context.Background(), "--profile", "observability", "logs", "--tail", "40")
			t.Logf("compose logs:\n%s", out)
		}
		_, _ = s.run(context.Background(), "--profile", "observability", "down", "-v", "--remove-orphans", "-t", "5")
	})
	wall := clock.New()
	began := wall.Now()
	s.mustRun("--profile", "observability", "up", "-d", "--scale", "fakedaemon=2")
	upTook := clock.Since(wall, began)
	s.credentials()
	nodes := s.waitAdopted(2, 3*time.Minute)
	t.Logf("observability profile: up -d took %s, 2 machines adopted %s after it began", upTook, clock.Since(wall, began))

	pool, tenant := s.envValue("BETTER_COMPUTE_POOL"), s.envValue("BETTER_COMPUTE_TENANT")
	s.cliRun("pools", "offer", pool, "--to", tenant, "--quota", "gpu=64")
	var r struct {
		ID     string `json:"id"`
		State  string `json:"state"`
		NodeID string `json:"nodeId"`
	}
	out := s.cliRun("reserve", "--pool", pool, "--gpus", "1", "--for", "1h", "--wait", "--timeout", "120s")
	require.NoError(t, json.Unmarshal([]byte(out), &r), out)
	require.Equal(t, "active", r.State, out)
	var c struct {
		ID    string `json:"id"`
		State string `json:"state"`
	}
	out = s.cliRun("commands", "run", "--node", nodes[0].ID, "inventory.refresh", "--wait")
	require.NoError(t, json.Unmarshal([]byte(out), &c), out)
	require.Equal(t, "succeeded", c.State, out)

	prom := fmt.Sprintf("http://127.0.0.1:%d", promPort)
	// Every service's every replica is scraped.
	require.Eventually(t, func() bool {
		jobs := map[string]float64{}
		for _, v := range promQuery(t, prom, `up`) {
			jobs[v.Metric["job"]] += v.value()
		}
		want := map[string]float64{"api": 1, "joinservice": 1, "gateway": 2, "scheduler": 1, "controllers": 1}
		return cmp.Diff(want, jobs) == ""
	}, 2*time.Minute, time.Second, "every scrape target up")
	for _, q := range []string{
		`bc_commands_finished_total{kind="inventory.refresh",state="succeeded"}`,
		`bc_commands_duration_seconds_count{kind="inventory.refresh",state="succeeded"}`,
		`rpc_server_call_duration_seconds_count{rpc_method="bc.compute.v1.CommandService/RunCommand"}`,
		`bc_reservations_activation_seconds_count`,
		`bc_commands_created_total{kind="inventory.refresh"}`,
	} {
		require.Eventually(t, func() bool {
			sum := 0.0
			for _, v := range promQuery(t, prom, q) {
				sum += v.value()
			}
			return sum >= 1
		}, 2*time.Minute, time.Second, "Prometheus has %s >= 1", q)
	}
	// The machines' sessions, per gateway, add up to the fleet.
	require.Eventually(t, func() bool {
		sum := 0.0
		for _, v := range promQuery(t, prom, `bc_gateway_sessions`) {
			if v.Metric["gateway_id"] == "" {
				return false
			}
			sum += v.value()
		}
		return sum == 2
	}, 2*time.Minute, time.Second, "bc_gateway_sessions adds up to 2")
	// The rules are loaded.
	require.Eventually(t, func() bool {
		return len(promQuery(t, prom, `bc:gateway_heartbeats:rate1m`)) > 0
	}, 2*time.Minute, time.Second, "the recording rules evaluate")

	// One trace of the command crosses every hop.
	jaeger := fmt.Sprintf("http://127.0.0.1:%d", jaegerPort)
	want := []string{"api", "better-compute", "controllers", "fakedaemon", "gateway"}
	var last []string
	defer func() {
		if t.Failed() {
			var services, ops any
			getJSON(t, jaeger+"/api/services", &services)
			getJSON(t, jaeger+"/api/services/better-compute/operations", &ops)
			t.Logf("jaeger services: %v; operations of better-compute: %v", services, ops)
		}
	}()
	require.Eventually(t, func() bool {
		for _, tr := range jaegerTraces(t, jaeger, "better-compute", "better-compute commands run") {
			var services []string
			for _, p := range tr.Processes {
				services = append(services, p.ServiceName)
			}
			sort.Strings(services)
			services = slices.Compact(services)
			last = services
			if cmp.Diff(want, services) == "" && tr.has("daemon run command") && tr.has("gateway deliver command") {
				return true
			}
		}
		return false
	}, 2*time.Minute, 2*time.Second, "a trace of `commands run` with spans of %v; last: %v", want, &last)
}

// promSample is one element of an instant query's vector.
type promSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

func (p promSample) value() float64 {
	s, _ := p.Value[1].(string)
	v, _ := strconv.ParseFloat(s, 64)
	return v
}

// promQuery runs an instant query on Prometheus's HTTP API; nil while it
// does not answer.
func promQuery(t *testing.T, base, q string) []promSample {
	t.Helper()
	var body struct {
		Status string `json:"status"`
		Data   struct {
			Result []promSample `json:"result"`
		} `json:"data"`
	}
	if !getJSON(t, base+"/api/v1/query?query="+url.QueryEscape(q), &body) || body.Status != "success" {
		return nil
	}
	return body.Data.Result
}

// jaegerTrace is one trace of Jaeger's query API.
type jaegerTrace struct {
	Spans []struct {
		OperationName string `json:"operationName"`
	} `json:"spans"`
	Processes map[string]struct {
		ServiceName string `json:"serviceName"`
	} `json:"processes"`
}

func (tr jaegerTrace) has(op string) bool {
	for _, s := range tr.Spans {
		if s.OperationName == op {
			return true
		}
	}
	return false
}

// jaegerTraces returns the traces of service with operation; nil while
// Jaeger does not answer.
func jaegerTraces(t *testing.T, base, service, operation string) []jaegerTrace {
	t.Helper()
	var body struct {
		Data []jaegerTrace `json:"data"`
	}
	q := url.Values{"service": {service}, "operation": {operation}, "limit": {"20"}, "lookback": {"1h"}}
	if !getJSON(t, base+"/api/traces?"+q.Encode(), &body) {
		return nil
	}
	return body.Data
}

// getJSON GETs u into v; false (logged) when it fails.
func getJSON(t *testing.T, u string, v any) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Logf("GET %s: %v", u, err)
		return false
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Logf("GET %s: %d %v: %.300s", u, resp.StatusCode, err, b)
		return false
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Logf("GET %s: %v: %.300s", u, err, b)
		return false
	}
	return true
}
