package inprocess_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// scrape is one GET /metrics, by family name.
type scrape map[string]*dto.MetricFamily

func scrapeMetrics(t *testing.T, url string) scrape {
	t.Helper()
	res, err := http.Get(url) //nolint:noctx // a test's loopback scrape
	require.NoError(t, err)
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(res.Body)
	require.NoError(t, err)
	return fams
}

// value is the value of the series of family name whose labels include
// want (a counter's, gauge's, or a histogram's count), summed over the
// series that match; 0 when none does.
func (s scrape) value(name string, want map[string]string) float64 {
	base, count := name, false
	if b, ok := strings.CutSuffix(name, "_count"); ok && s[name] == nil {
		base, count = b, true
	}
	f := s[base]
	if f == nil {
		return 0
	}
	var sum float64
	for _, m := range f.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		match := true
		for k, v := range want {
			if labels[k] != v {
				match = false
			}
		}
		if !match {
			continue
		}
		switch {
		case count:
			sum += float64(m.GetHistogram().GetSampleCount())
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		}
	}
	return sum
}

// TestMetrics runs the stack (every service, one pipeline), joins two
// machines, places a reservation and runs two commands, and scrapes GET
// /metrics: the series of docs/metrics.md are there with the figures of
// that work, every series exported is in the catalog with its labels, and
// no label holds an id of a node, reservation, command, tenant or token the
// test made.
func TestMetrics(t *testing.T) {
	f := setupWith(t, devstack.Options{HeartbeatInterval: time.Second})
	st := f.stack
	require.NotEmpty(t, st.MetricsURL)
	before := scrapeMetrics(t, st.MetricsURL)

	nodes := f.join(t, devstack.JoinOptions{Count: 2}, store.NodeAdopted)
	tenant := f.offer(t, "metrics", 8)
	r := f.reserve(t, tenant, 4, time.Hour)
	f.waitState(t, r.ID, store.ReservationActive, activeWithin)
	commands := computev1connect.NewCommandServiceClient(http.DefaultClient, st.APIURL+"/api/compute", st.ClientOptions()...)
	var commandIDs []string
	for range 2 {
		res, err := commands.RunCommand(t.Context(), connect.NewRequest(&computev1.RunCommandRequest{NodeId: nodes[0],
			Kind: "inventory.refresh"}))
		require.NoError(t, err)
		commandIDs = append(commandIDs, res.Msg.GetCommand().GetId())
	}
	for _, id := range commandIDs {
		require.Eventually(t, func() bool {
			res, err := commands.GetCommand(t.Context(), connect.NewRequest(&computev1.GetCommandRequest{CommandId: id}))
			return err == nil && res.Msg.GetCommand().GetState() == "succeeded"
		}, 30*time.Second, 50*time.Millisecond)
	}
	gw := st.Gateways[0].GatewayID()
	pool := f.pool
	refresh := map[string]string{"kind": "inventory.refresh"}
	refreshOK := map[string]string{"kind": "inventory.refresh", "state": "succeeded"}

	// The gauges read from the database need the liveness lease, the
	// heartbeats a second: wait for what the work implies.
	var s scrape
	require.Eventually(t, func() bool {
		s = scrapeMetrics(t, st.MetricsURL)
		return s.value("bc_reservations", map[string]string{"state": "active"}) == 1 &&
			s.value("bc_gateway_heartbeats_total", nil) > 0 && s.value("bc_liveness_sweeps_total", nil) > 0
	}, 30*time.Second, 100*time.Millisecond, "the fleet's gauges and the heartbeats")
	delta := func(name string, labels map[string]string) float64 {
		return s.value(name, labels) - before.value(name, labels)
	}

	got := map[string]float64{
		"commands created":            delta("bc_commands_created_total", refresh),
		"commands succeeded":          delta("bc_commands_finished_total", refreshOK),
		"command latencies":           delta("bc_commands_duration_seconds_count", refreshOK),
		"acceptance commands":         delta("bc_commands_finished_total", map[string]string{"kind": "diag.nvml", "state": "succeeded"}),
		"sessions":                    s.value("bc_gateway_sessions", map[string]string{"gateway_id": gw}),
		"sessions opened":             delta("bc_gateway_sessions_opened_total", map[string]string{"gateway_id": gw}),
		"joins":                       delta("bc_join_attempts_total", map[string]string{"outcome": "joined"}),
		"reservations active":         s.value("bc_reservations", map[string]string{"state": "active"}),
		"reservations pending":        s.value("bc_reservations", map[string]string{"state": "pending"}),
		"activations":                 delta("bc_reservations_activation_seconds_count", nil),
		"placements":                  delta("bc_scheduler_placements_total", nil),
		"gpus booked":                 s.value("bc_gpus", map[string]string{"pool_id": pool, "state": "booked"}),
		"gpus free":                   s.value("bc_gpus", map[string]string{"pool_id": pool, "state": "free"}),
		"nodes adopted and reachable": s.value("bc_nodes", map[string]string{"provision_state": "adopted", "reachable": "true"}),
		"nodes joining":               s.value("bc_nodes", map[string]string{"provision_state": "joining"}),
		"scheduler lease":             s.value("bc_lease_held", map[string]string{"lease": "scheduler"}),
		"liveness lease":              s.value("bc_lease_held", map[string]string{"lease": "controllers.liveness"}),
		"RunCommand calls":            delta("rpc_server_call_duration_seconds_count", map[string]string{"rpc_method": "bc.compute.v1.CommandService/RunCommand", "rpc_response_status_code": "OK"}),
	}
	want := map[string]float64{
		"commands created": 2, "commands succeeded": 2, "command latencies": 2, "acceptance commands": 2,
		"sessions": 2, "sessions opened": 2, "joins": 2,
		"reservations active": 1, "reservations pending": 0, "activations": 1, "placements": 1,
		"gpus booked": 4, "gpus free": 12, "nodes adopted and reachable": 2, "nodes joining": 0,
		"scheduler lease": 1, "liveness lease": 1, "RunCommand calls": 2,
	}
	require.Empty(t, cmp.Diff(want, got), "figures (-want +got)")
	for _, name := range []string{"bc_outbox_backlog", "bc_outbox_oldest_age_seconds", "pgxpool_total_connections",
		"pgxpool_acquires_total", "bc_gateway_pokes_total", "bc_outbox_published_total"} {
		require.Contains(t, s, name)
	}
	require.Positive(t, s.value("bc_outbox_published_total", map[string]string{"subject": "poke.gw"}), "pokes sent")
	require.Contains(t, s, "bc_commands_open")
	require.Zero(t, s.value("bc_commands_open", nil), "every command finished")
	require.Len(t, s["bc_commands_open"].GetMetric(), 4*3, "each kind and open state, 0 when none")
	require.Positive(t, s.value("pgxpool_total_connections", map[string]string{"db_client_connection_pool_name": "main"}))

	// Every series is the catalog's, with the catalog's labels.
	catalog := map[string]telemetry.Instrument{}
	for _, in := range telemetry.Catalog() {
		catalog[in.PrometheusName()] = in
	}
	for name, fam := range s {
		if strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") || name == "target_info" ||
			strings.HasPrefix(name, "promhttp_") {
			continue
		}
		in, ok := catalog[name]
		require.True(t, ok, "%s is exported but not in telemetry.Catalog (docs/metrics.md)", name)
		require.Equal(t, string(in.Kind), strings.ToLower(fam.GetType().String()), "%s's type", name)
		allowed := append(in.PrometheusLabels(), "otel_scope_name", "otel_scope_version", "otel_scope_schema_url")
		for _, m := range fam.GetMetric() {
			for _, l := range m.GetLabel() {
				require.True(t, slices.Contains(allowed, l.GetName()), "%s has label %s, which the catalog does not list", name, l.GetName())
			}
		}
	}

	// No label value holds an id or a secret the test made.
	secrets := append(append(append([]string{}, nodes...), commandIDs...), r.ID, tenant, st.TenantID, st.RootToken)
	for name, fam := range s {
		for _, m := range fam.GetMetric() {
			for _, l := range m.GetLabel() {
				for _, id := range secrets {
					require.NotContains(t, l.GetValue(), id, "%s{%s} holds an id", name, l.GetName())
				}
			}
		}
	}
}
