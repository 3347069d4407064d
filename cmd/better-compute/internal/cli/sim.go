package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/sim"
)

func (a *app) simCmd() *cobra.Command {
	var (
		seed             string
		nodes            int
		duration, settle time.Duration
		chaos, logPath   string
	)
	c := &cobra.Command{
		Use:   "sim [--seed SEED] [--nodes N] [--duration D] [--settle D] [--chaos none|light|heavy] [--log PATH]",
		Short: "Run the deterministic fleet simulator and check the invariants",
		Long: "Run --nodes daemon cores (the fakedaemon's) on fake hardware against an in-memory gateway stub,\n" +
			"entirely in simulated time: --duration of steady workload (every 2 s three commands, a GPU booking and\n" +
			"sometimes a release) with the faults of --chaos, then --settle of quiet; then check the invariants.\n" +
			"Nothing reads the wall clock, so the same seed prints the same digest (SHA-256 of the event log).\n" +
			"Prints a JSON report; on a violation it exits 1 with SIM_INVARIANT_VIOLATED (re-run with the same\n" +
			"--seed to reproduce it, with --log PATH for the event log).\n\n" +
			"Invariants checked (each says what it exercises: I1 node-held devices, I2, I3 and progress test the\n" +
			"daemon core; I4 the stub's model of the gateways' batched last_seen, presence and the sweeper; I1\n" +
			"bookings, I5 and I8 only the stub's own bookkeeping):\n  " + strings.Join(sim.Invariants(), "\n  "),
		Args: cobra.NoArgs,
	}
	bound := fmt.Sprintf("%s to %s", sim.WorkloadEvery, sim.MaxDuration)
	c.Flags().StringVar(&seed, "seed", sim.DefaultSeed, "everything random derives from it (not empty)")
	c.Flags().IntVar(&nodes, "nodes", sim.DefaultNodes, fmt.Sprintf("simulated nodes, 1 to %d", sim.MaxNodes))
	c.Flags().DurationVar(&duration, "duration", sim.DefaultDuration, "simulated time under workload (30s, 10m, 2h), "+bound)
	c.Flags().DurationVar(&settle, "settle", sim.DefaultSettle,
		"quiet simulated time afterwards, so the sweeper and replays settle, 0 to "+sim.MaxDuration.String())
	c.Flags().StringVar(&chaos, "chaos", string(sim.DefaultChaos), "none, light or heavy")
	c.Flags().StringVar(&logPath, "log", "", "write the event log to a new file (fails if it exists)")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		for _, name := range []string{"seed", "chaos", "log"} {
			if f := cmd.Flags().Lookup(name); f.Changed && f.Value.String() == "" {
				return fmt.Errorf("--%s: must not be empty", name)
			}
		}
		cfg := sim.Config{Seed: seed, Nodes: nodes, Duration: duration, Settle: settle, Chaos: sim.Chaos(chaos), Clock: a.env.Clock}
		if err := cfg.Validate(); err != nil {
			return simFlagError(err)
		}
		var logFile *os.File
		if logPath != "" {
			f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("--log: %s exists; the simulator writes only a new file", logPath)
			}
			if err != nil {
				return fmt.Errorf("--log: %w", err)
			}
			logFile = f
			cfg.Log = f
		}
		r, err := sim.Run(cfg)
		if logFile != nil {
			if cerr := logFile.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("%w: %w", sim.ErrLog, cerr)
			}
			if r == nil {
				// The run never started (validated above, so not expected):
				// leave no file behind.
				_ = os.Remove(logPath)
			}
		}
		if r == nil {
			return err
		}
		var logErr error
		if err != nil {
			logErr = fmt.Errorf("--log: %w (the report on stdout is complete; the log file is not)", err)
		}
		if err := writeJSON(a.env.Stdout, r); err != nil {
			return errors.Join(logErr, err)
		}
		return errors.Join(logErr, r.Err())
	}
	return c
}

// simFlagError names the flag of a configuration error.
func simFlagError(err error) error {
	msg := err.Error()
	for _, f := range []struct{ field, flag string }{
		{"nodes", "--nodes"}, {"duration", "--duration"}, {"settle", "--settle"}, {"chaos", "--chaos"},
	} {
		if strings.Contains(msg, ": "+f.field+" must") {
			return fmt.Errorf("%s: %w", f.flag, err)
		}
	}
	return err
}
