package bench

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
)

// The figures of issue 19's table: each benchmark records its figures here
// (and as benchmark metrics); TestMain prints them once all runs (`-count
// N`) are done, each as min, median and max over the runs, after a line
// naming the machine.

// figure is a row of the table.
type figure struct {
	// name says what is measured, unit its unit, target the project's.
	name, unit, target string
	// metric is its b.ReportMetric unit.
	metric string
}

// The table's rows, in the order.
var (
	figCPUPerCommand  = figure{"control-plane CPU per command at saturation (services + Postgres + NATS)", "ms", "≤ 0.30", "cp-ms/command"}
	figCommandsPerSec = figure{"commands completed per second at saturation", "/s", "", "commands/s"}
	figCommandRTp50   = figure{"command round trip at half saturation, p50", "ms", "", "rt-p50-ms"}
	figCommandRTp99   = figure{"command round trip at half saturation, p99", "ms", "< 50", "rt-p99-ms"}
	figCreatedPlaced  = figure{"reservation created → placed, p50 (at 200/s)", "ms", "≤ 20", "placed-p50-ms"}
	figActiveP50      = figure{"Reserve → active at 200/s, p50", "ms", "", "active-p50-ms"}
	figActiveP99      = figure{"Reserve → active at 200/s, p99", "ms", "< 150", "active-p99-ms"}
	figPlacements     = figure{"placements per second (2 × machines reservations, scheduler alone)", "/s", "≥ 3,000", "placed/s"}
	figCPUPerPlace    = figure{"control-plane CPU per placement", "ms", "", "cp-ms/placement"}
	figAdopted        = figure{"join → adopted, machines adopted per second", "/s", "≥ 250", "adopted/s"}
	figAdoptedP99     = figure{"join → adopted, p99", "ms", "", "adopt-p99-ms"}
	figCPUPerJoin     = figure{"join → adopted, control-plane CPU per machine", "ms", "≤ 2", "cp-ms/machine"}
	figIdlePerK       = figure{"idle connected machines: control plane per 1,000 machines", "% core", "≤ 1", "idle-%core/1000"}
	figIdleWith       = figure{"idle: control plane with the machines", "% core", "", "cp-%core"}
	figIdleWithout    = figure{"idle: control plane with no machine", "% core", "", "cp0-%core"}
	figGatewayRSS     = figure{"gateway RSS per idle session", "KiB", "≤ 32", "gw-KiB/session"}
	figGatewayHeap    = figure{"gateway heap + stacks per idle session", "KiB", "", "gw-heap-KiB/session"}
)

// figureOrder is the order rows are printed in.
var figureOrder = []figure{figCPUPerCommand, figCommandsPerSec, figCommandRTp50, figCommandRTp99, figCreatedPlaced,
	figActiveP50, figActiveP99, figPlacements, figCPUPerPlace, figAdopted, figAdoptedP99, figCPUPerJoin,
	figIdlePerK, figIdleWith, figIdleWithout, figGatewayRSS, figGatewayHeap}

var (
	figuresMu sync.Mutex
	figures   = map[string][]float64{}
)

// record adds one run's value of fig and reports it as a metric of b.
func record(b *testing.B, fig figure, v float64) {
	b.ReportMetric(v, fig.metric)
	figuresMu.Lock()
	defer figuresMu.Unlock()
	figures[fig.name] = append(figures[fig.name], v)
}

// printFigures prints the machine and the table of the figures recorded
// (nothing when none was).
func printFigures(w io.Writer) {
	figuresMu.Lock()
	defer figuresMu.Unlock()
	if len(figures) == 0 {
		return
	}
	fmt.Fprintf(w, "\n%s\n\n", machineLine())
	fmt.Fprintln(w, "| figure | runs | min | median | max | target |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- |")
	for _, fig := range figureOrder {
		vs := slices.Clone(figures[fig.name])
		if len(vs) == 0 {
			continue
		}
		slices.Sort(vs)
		f := func(v float64) string { return formatFigure(v) + " " + fig.unit }
		target := fig.target
		if target == "" {
			target = "—"
		} else {
			target += " " + fig.unit
		}
		fmt.Fprintf(w, "| %s | %d | %s | %s | %s | %s |\n", fig.name, len(vs), f(vs[0]), f(median(vs)), f(vs[len(vs)-1]), target)
	}
	fmt.Fprintln(w)
}

// median is the median of sorted vs (the mean of the middle two for an
// even count).
func median(vs []float64) float64 {
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}

// formatFigure prints v with 3 significant digits at least, no exponent.
func formatFigure(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	case v >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

// machineLine names the machine: cores, CPU model, kernel, Go version.
func machineLine() string {
	model := "unknown CPU"
	if raw, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(raw), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	kernel := "unknown kernel"
	if raw, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		kernel = "Linux " + strings.TrimSpace(string(raw))
	}
	return fmt.Sprintf("machine: %d cores, %s, %s, %s, %s/%s", runtime.NumCPU(), model, kernel, runtime.Version(),
		runtime.GOOS, runtime.GOARCH)
}
