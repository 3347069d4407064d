package controllers_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// TestFleetGaugesComeFromOneReplica: of two controllers replicas on one
// database, only the one holding the liveness lease exports the fleet's
// gauges (bc_nodes, bc_gpus, …), so that summing over replicas counts the
// fleet once; both export bc_lease_held, with 1 where they hold a lease.
func TestFleetGaugesComeFromOneReplica(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	storetest.NewFleetWith(t, db, storetest.FleetOpts{Name: "m", GPUs: []int{8, 8}})
	_, nc := startNATS(t)
	type replica struct {
		srv *controllers.Server
		url string
	}
	var replicas []replica
	ctx, cancel := context.WithCancel(t.Context())
	var errcs []chan error
	for _, holder := range []string{"replica-1", "replica-2"} {
		m, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterPrometheus, "controllers")
		require.NoError(t, err)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		srv, err := controllers.New(controllers.Config{Probes: service.Probes{HealthListener: ln}, ReconcileInterval: time.Hour,
			Leases: service.Leases{Holder: holder}}, controllers.Deps{DB: db, NC: nc, Metrics: m})
		require.NoError(t, err)
		errc := make(chan error, 1)
		go func() { errc <- srv.Run(ctx) }()
		errcs = append(errcs, errc)
		replicas = append(replicas, replica{srv, "http://" + ln.Addr().String() + "/metrics"})
	}
	t.Cleanup(func() {
		cancel()
		for _, errc := range errcs {
			require.NoError(t, <-errc)
		}
	})
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	scrape := func(url string) string {
		resp, err := hc.Get(url)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		return string(body)
	}
	liveness := `bc_lease_held{lease="controllers.liveness",`
	var bodies [2]string
	require.Eventually(t, func() bool {
		held := 0
		for i, r := range replicas {
			bodies[i] = scrape(r.url)
			if lineValue(bodies[i], liveness) == "1" {
				held++
			}
		}
		return held == 1
	}, 20*time.Second, 50*time.Millisecond, "one replica holds the liveness lease")
	holder, standby := bodies[0], bodies[1]
	if lineValue(holder, liveness) != "1" {
		holder, standby = standby, holder
	}
	require.Equal(t, "0", lineValue(standby, liveness), "the standby reports the lease it waits for")
	require.Equal(t, "2", lineValue(holder, `bc_nodes{otel_scope_name="github.com/better-compute/better-compute/services/controllers",otel_scope_schema_url="",otel_scope_version="",provision_state="adopted",reachable="true"}`))
	require.Equal(t, "16", lineValue(holder, `bc_gpus{`), "the fleet's GPUs, all free (the one bc_gpus series)")
	for _, fam := range []string{"bc_nodes", "bc_gpus", "bc_reservations", "bc_commands_open", "bc_outbox_backlog"} {
		require.Contains(t, holder, "\n"+fam+"{", fam)
		require.NotContains(t, standby, "\n"+fam+"{", fam+" from the standby")
	}
}

// lineValue is the value of the first series line of body starting with
// prefix, "" when none.
func lineValue(body, prefix string) string {
	for l := range strings.Lines(body) {
		if strings.HasPrefix(l, prefix) {
			f := strings.Fields(l)
			return f[len(f)-1]
		}
	}
	return ""
}
