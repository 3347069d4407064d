package bench

import (
	"fmt"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/tests/internal/devproc"
)

// BenchmarkDev runs `better-compute dev` as a user does (the built binary,
// bin/linux/better-compute) and prints the laptop figures:
//
//   - launch → "N simulated node(s) adopted" for `dev --memory --sim N`,
//     N = 8, 100 and 1,000 (initdb, migrations, PKI, joins and acceptance
//     included; targets on a 2-core machine: 8 within 5 s, 1,000 within
//     20 s);
//   - with 1,000 idle machines: the dev process's resident memory and CPU
//     (the embedded PostgreSQL server's processes apart);
//   - a restart on kept data: launch → "listening" (target 1.5 s), and
//     launch → 8 machines adopted again.
func BenchmarkDev(b *testing.B) {
	for _, n := range []int{8, 100, 1000} {
		b.Run(fmt.Sprintf("adopted-%d", n), func(b *testing.B) {
			for range b.N {
				began := devproc.Wall.Now()
				d := devproc.Start(b, "", nil, "--memory", "--sim", fmt.Sprint(n), "--port", "0")
				listening := waitSince(b, d, began, `^better-compute listening on `)
				adopted := waitSince(b, d, began, fmt.Sprintf(`^%d simulated node\(s\) adopted$`, n))
				b.ReportMetric(adopted.Seconds(), "s-to-adopted")
				fmt.Printf("dev --memory --sim %d: listening %s, %d adopted %s after launch\n",
					n, listening.Round(time.Millisecond), n, adopted.Round(time.Millisecond))
				if n == 1000 {
					idleFigures(b, d, n)
				}
				require.Equal(b, 0, d.Stop(syscall.SIGTERM), d.Stderr())
			}
		})
	}
	b.Run("restart", func(b *testing.B) {
		for range b.N {
			dir := devproc.WorkDir(b)
			data := filepath.Join(dir, "kept")
			d := devproc.Start(b, dir, nil, "--data", data, "--sim", "8", "--port", "0")
			d.WaitLine(`^8 simulated node\(s\) adopted$`, 2*time.Minute)
			require.Equal(b, 0, d.Stop(syscall.SIGTERM), d.Stderr())

			began := devproc.Wall.Now()
			d = devproc.Start(b, dir, nil, "--data", data, "--sim", "8", "--port", "0")
			listening := waitSince(b, d, began, `^better-compute listening on `)
			adopted := waitSince(b, d, began, `^8 simulated node\(s\) adopted$`)
			require.Equal(b, 0, d.Stop(syscall.SIGTERM), d.Stderr())
			b.ReportMetric(listening.Seconds(), "s-to-listening")
			fmt.Printf("dev --data (kept) --sim 8, second run: listening %s after launch (target 1.5 s), 8 adopted %s\n",
				listening.Round(time.Millisecond), adopted.Round(time.Millisecond))
		}
	})
}

// waitSince waits for a line matching re and returns the time since began.
func waitSince(b *testing.B, d *devproc.Dev, began time.Time, re string) time.Duration {
	b.Helper()
	d.WaitLine(re, 2*time.Minute)
	return clock.Since(devproc.Wall, began)
}

// idleFigures prints the resident memory and CPU of dev with n idle
// machines, and of its PostgreSQL server, over 20 s.
func idleFigures(b *testing.B, d *devproc.Dev, n int) {
	b.Helper()
	// Let the sessions go idle (past Welcome and the first heartbeats).
	require.NoError(b, clock.Sleep(b.Context(), devproc.Wall, 10*time.Second))
	pg := devproc.Descendants(b, d.PID())
	cpu := func() (dev, postgres time.Duration) {
		dev = procCPU(b, d.PID())
		for _, pid := range pg {
			postgres += procCPU(b, pid)
		}
		return dev, postgres
	}
	const window = 20 * time.Second
	dev0, pg0 := cpu()
	require.NoError(b, clock.Sleep(b.Context(), devproc.Wall, window))
	dev1, pg1 := cpu()
	var pgRSS int64
	for _, pid := range pg {
		pgRSS += rssKiB(b, pid)
	}
	rss := rssKiB(b, d.PID())
	devShare := 100 * (dev1 - dev0).Seconds() / window.Seconds()
	pgShare := 100 * (pg1 - pg0).Seconds() / window.Seconds()
	b.ReportMetric(float64(rss)/1024, "dev-RSS-MiB")
	b.ReportMetric(devShare, "dev-idle-%core")
	fmt.Printf("dev with %d idle machines: resident %.0f MiB (%.0f KiB per machine, services and machines in one process), "+
		"%.1f %% of a core; its PostgreSQL: %d processes, %.0f MiB resident (shared pages counted per process), %.1f %% of a core\n",
		n, float64(rss)/1024, float64(rss)/float64(n), devShare, len(pg), float64(pgRSS)/1024, pgShare)
}
