// Command genmetrics writes the metrics reference, docs/metrics.md, from
// the instrument catalog the services make their instruments from
// (telemetry.Catalog): `make generate` runs it, and `make generate-check`
// fails when the file differs from what it writes. Each row gives the
// Prometheus name (as the exporter's translator builds it), the
// OpenTelemetry name, kind, unit, labels, the services that export it and
// what it means.
//
// To add a metric, add an Instrument to pkg/telemetry's catalog and make
// it with telemetry.Int64Counter (or the others) where it is measured;
// then run make generate.
//
// Usage: go run ./cmd/better-compute/internal/genmetrics PATH
package main

import (
	"bytes"
	"fmt"
	"os"
	"strings"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: genmetrics PATH")
		os.Exit(2)
	}
	if err := os.WriteFile(os.Args[1], render(), 0o644); err != nil { //nolint:gosec // a doc of the repository
		fmt.Fprintln(os.Stderr, "genmetrics:", err)
		os.Exit(1)
	}
}

const intro = `# Metrics reference

Generated from the instrument catalog (` + "`pkg/telemetry`, `Catalog`" + `) by ` + "`make generate`" + `
(cmd/better-compute/internal/genmetrics); do not edit. The services make their instruments from the same entries,
and a test scrapes a running stack and checks that every series it exports is listed here.

## Where the metrics are

Every service records its metrics with the OpenTelemetry metrics SDK. ` + "`BETTER_COMPUTE_METRICS_EXPORTER`" + `
([configuration.md](configuration.md)) says where they go: ` + "`prometheus`" + ` (the default) serves them in the
Prometheus text format on ` + "`GET /metrics`" + ` of the listener that serves the service's probes
(` + "`/healthz`, `/readyz`" + `): the API's and JoinService's own listeners, and the probes listeners of the gateway
(` + "`:8082`" + `), the scheduler (` + "`:8083`" + `) and the controllers (` + "`:8084`" + `); ` + "`otlp`" + ` pushes them every
15 s over OTLP/HTTP to ` + "`OTEL_EXPORTER_OTLP_ENDPOINT`" + ` (which must be set), and ` + "`none`" + ` records nothing. Any
other value stops the service at start with one line naming the variable. Besides the metrics below, each
Prometheus endpoint serves the Go runtime's and the process's own (` + "`go_*`, `process_*`" + `) and
` + "`target_info`" + `, whose ` + "`service_name`" + ` names the service.

` + "`better-compute dev`" + ` runs every service in one process with one pipeline: its ` + "`GET /metrics`" + ` is on the
API's address (printed at start). The series of one metric still tell the services apart: every metric but the
shared ones below is exported by one service only (the table's last column), each series carries
` + "`otel_scope_name`" + `, the instrumenting package (` + "`…/services/gateway`" + `, ` + "`…/services/controllers`" + `,
` + "`…/pkg/outbox`" + `), the gateways' series carry ` + "`gateway_id`" + `, the leases' ` + "`lease`" + `, and the RPC histograms
` + "`rpc_method`" + ` (` + "`bc.compute.v1.*`" + ` is the API, ` + "`bc.join.v1.*`" + ` JoinService). The pool statistics are the
one database pool the dev services share.

## Labels and cardinality

No label holds a node, reservation, command, token or tenant id, or anything else a machine or a tenant can
multiply: label values are the code's own (states, kinds, reasons, outcomes, Connect codes, procedures) or are
bounded by operator action: ` + "`gateway_id`" + ` (one per gateway replica), ` + "`lease`" + ` (one per role),
` + "`server_address`" + `/` + "`server_port`" + ` (the gateways' control addresses) and ` + "`pool_id`/`pool_name`" + ` of
` + "`bc_gpus`" + `. A pool is made by an administrator (` + "`pools create`" + `), a fleet has a few to a few hundred, and
capacity per pool is what an operator plans with, so both are labels; the id because names repeat across
sites, the name for people.

## Gauges read from the database

The figures of the whole fleet (nodes by provision state, GPUs per pool, live reservations, open commands, the
outbox backlog and its age) are observable gauges read with one query (` + "`store.FleetStatsAt`" + `) at each
collection, by the controllers replica that holds the liveness lease (` + "`controllers.liveness`" + `,
` + "`bc_lease_held{lease=\"controllers.liveness\"} == 1`" + `) only: the other replicas export none of them, so a sum
over replicas counts the fleet once. ` + "`bc_lease_held`" + ` itself is exported by every replica of the scheduler and
the controllers, 1 for each lease it holds and 0 for each it stands by for.

## Rules

` + "`deploy/observability/rules.yml`" + ` holds the Prometheus rules of compose's observability profile
([compose.md](compose.md), "Observability"), written with the names below: recording rules for the command rate
and p99 latency, the RPCs' p99 latency and heartbeats per gateway, and alerts for the failure modes that stop
work without stopping a service: ` + "`OutboxBacklogOld`" + ` (the oldest unpublished outbox row older than 60 s for
2 min), ` + "`OutboxRelayFailing`" + ` (more than 3 failed relay passes in 5 min), ` + "`OutboxDeadLetters`" + ` (a row
set aside), ` + "`GatewayWithoutSessions`" + ` and ` + "`NoGatewaySessions`" + ` (gateways holding no session while machines
are adopted), ` + "`ReservationsStuckBinding`" + ` (reservations binding for 10 min). A test
(tests/compose TestObservabilityRules) runs ` + "`promtool check config`" + ` on them and checks that every metric they
name is in this catalog.

## Metrics

| Prometheus name | OpenTelemetry name | type | unit | labels | exported by | meaning |
| --- | --- | --- | --- | --- | --- | --- |
`

func render() []byte {
	var b bytes.Buffer
	b.WriteString(intro)
	for _, in := range telemetry.Catalog() {
		labels := "—"
		if l := in.PrometheusLabels(); len(l) > 0 {
			labels = "`" + strings.Join(l, "`, `") + "`"
		}
		unit := in.Unit
		if unit == "" {
			unit = "1"
		}
		desc := in.Description
		if len(in.Buckets) > 0 {
			desc += fmt.Sprintf(" Buckets: %s.", strings.Trim(strings.Join(strings.Fields(fmt.Sprint(in.Buckets)), ", "), "[]"))
		}
		fmt.Fprintf(&b, "| `%s` | `%s` | %s | `%s` | %s | %s | %s |\n", in.PrometheusName(), in.Name, in.Kind, unit,
			labels, strings.Join(in.Services, ", "), strings.ReplaceAll(desc, "|", "\\|"))
	}
	return b.Bytes()
}
