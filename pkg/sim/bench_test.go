package sim

import (
	"fmt"
	"runtime/metrics"
	"testing"
	"time"
)

// BenchmarkSim measures the simulator at 50, 500 and 5,000 nodes under
// heavy chaos (the first two for 1 h, the last for 10 min, each with the
// default settle): simulated seconds per wall second, scheduler events per
// wall second and the peak of the live heap, sampled every 65,536 events.
// Targets: 500 nodes × 1 h and 5,000 nodes × 10 min in at most 60 s each.
func BenchmarkSim(b *testing.B) {
	for _, c := range []struct {
		nodes    int
		duration time.Duration
	}{{50, time.Hour}, {500, time.Hour}, {5000, 10 * time.Minute}} {
		b.Run(fmt.Sprintf("nodes=%d/duration=%s", c.nodes, c.duration), func(b *testing.B) {
			sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
			var peak uint64
			read := func() {
				metrics.Read(sample)
				peak = max(peak, sample[0].Value.Uint64())
			}
			var simulated time.Duration
			var events int64
			b.ResetTimer()
			for range b.N {
				r, err := Run(Config{Seed: "bench", Nodes: c.nodes, Duration: c.duration, Settle: DefaultSettle, Chaos: ChaosHeavy, sample: read})
				if err != nil {
					b.Fatal(err)
				}
				if r.Violations > 0 {
					b.Fatal(r.Err())
				}
				simulated += time.Duration(r.SimulatedMs) * time.Millisecond
				events += r.Events
			}
			read()
			wall := b.Elapsed().Seconds()
			b.ReportMetric(simulated.Seconds()/wall, "sim-s/s")
			b.ReportMetric(float64(events)/wall, "events/s")
			b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MB")
		})
	}
}
