package sim

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/daemon"
)

func run(t *testing.T, cfg Config) *Report {
	t.Helper()
	r, err := Run(cfg)
	require.NoError(t, err)
	return r
}

// TestDeterministic runs the same seed at GOMAXPROCS 1 and 4: the digests
// (and the logs) are equal; another seed gives another digest.
func TestDeterministic(t *testing.T) {
	cfg := Config{Seed: "det", Nodes: 60, Duration: 4 * time.Minute, Settle: 2 * time.Minute, Chaos: ChaosHeavy}
	var logs [2]bytes.Buffer
	var digests [2]string
	prev := runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(prev)
	for i, procs := range []int{1, 4} {
		runtime.GOMAXPROCS(procs)
		c := cfg
		c.Log = &logs[i]
		digests[i] = run(t, c).Digest
	}
	require.Equal(t, digests[0], digests[1])
	require.Equal(t, logs[0].String(), logs[1].String())
	sum := sha256.Sum256(logs[0].Bytes())
	require.Equal(t, hex.EncodeToString(sum[:]), digests[0], "the digest is SHA-256 of the event log")
	require.Greater(t, strings.Count(logs[0].String(), "\n"), 1000)

	other := cfg
	other.Seed = "det2"
	require.NotEqual(t, digests[0], run(t, other).Digest)
	// Without a log the digest is the same.
	require.Equal(t, digests[0], run(t, cfg).Digest)
}

// TestCleanRuns: the daemon core keeps every invariant at every chaos
// level, every checker is fed, and every command ends.
func TestCleanRuns(t *testing.T) {
	for _, chaos := range []Chaos{ChaosNone, ChaosLight, ChaosHeavy} {
		t.Run(string(chaos), func(t *testing.T) {
			r := run(t, Config{Seed: "clean-" + string(chaos), Nodes: 40, Duration: 10 * time.Minute, Settle: DefaultSettle, Chaos: chaos})
			require.Zero(t, r.Violations, "%+v", r.FirstViolations)
			require.NoError(t, r.Err())
			require.Equal(t, 10*60*3/2-3, r.Commands.Total) // three every 2 s, from 2 s to 9m58s
			require.Zero(t, r.Commands.Open)
			c := r.Commands
			require.Equal(t, c.Total, c.Open+c.Succeeded+c.Failed+c.Expired, "%+v", c)
			require.Greater(t, c.Succeeded, c.Total/2, "%+v", c)
			if chaos == ChaosNone {
				require.Zero(t, c.Expired, "%+v", c)
			}
			kinds := []RecordKind{RecHeard, RecBookingStart, RecReleaseRequested, RecBookingEnd, RecNodeHolds,
				RecCommandCreated, RecExecuted, RecSpecDelivered, RecSpecObserved, RecUsageWindow,
				RecCommandReceived, RecCommandEnded, RecBound, RecDown}
			require.Equal(t, int64((10*time.Minute+DefaultSettle)/time.Millisecond), r.SimulatedMs)
			switch chaos {
			case ChaosHeavy:
				kinds = append(kinds, RecJournalLost, RecUnreachable, RecReachable)
				require.Positive(t, r.Faults.Crashes)
				require.Positive(t, r.Faults.Reboots)
				require.Positive(t, r.Faults.JournalLosses)
			case ChaosNone:
				require.Zero(t, r.Faults)
				require.Zero(t, r.Records[RecUnreachable])
			}
			for _, k := range kinds {
				require.Positive(t, r.Records[k], "records of kind %d", k)
			}
		})
	}
}

// forgetfulJournal is a daemon that skips its journal: it never writes.
type forgetfulJournal struct{ daemon.Journal }

func (forgetfulJournal) Put(daemon.Entry) error { return nil }

// TestSkippedJournalIsCaught seeds a bug — daemons whose journal forgets
// every command — and sees I2 violated: commands run that the journal does
// not hold.
func TestSkippedJournalIsCaught(t *testing.T) {
	r := run(t, Config{
		Seed: "forgetful", Nodes: 50, Duration: 10 * time.Minute, Settle: DefaultSettle, Chaos: ChaosHeavy,
		wrapJournal: func(j daemon.Journal) daemon.Journal { return forgetfulJournal{j} },
	})
	require.Positive(t, r.Violations)
	require.NotEmpty(t, r.FirstViolations)
	require.LessOrEqual(t, len(r.FirstViolations), MaxFirstViolations)
	require.Equal(t, "I2", r.FirstViolations[0].Invariant)
	require.Contains(t, r.FirstViolations[0].Detail, "journal does not hold")
	err := r.Err()
	require.True(t, errors.Is(err, ErrInvariantViolated))
	require.True(t, strings.HasPrefix(err.Error(), "SIM_INVARIANT_VIOLATED: "), err.Error())
	require.Contains(t, err.Error(), "I2")
	require.Contains(t, err.Error(), `--seed 'forgetful'`)
}

// TestDaemonRunningNothingIsCaught seeds a bug — every Command is dropped
// before the Agent, so no daemon runs anything — and sees the progress
// check fail with and without chaos.
func TestDaemonRunningNothingIsCaught(t *testing.T) {
	for _, chaos := range []Chaos{ChaosNone, ChaosHeavy} {
		t.Run(string(chaos), func(t *testing.T) {
			r := run(t, Config{Seed: "lazy", Nodes: 30, Duration: 10 * time.Minute, Settle: DefaultSettle, Chaos: chaos, dropCommands: true})
			require.Zero(t, r.Commands.Succeeded)
			require.Equal(t, r.Commands.Total, r.Commands.Expired)
			require.Positive(t, r.Violations)
			require.True(t, slices.ContainsFunc(r.FirstViolations, func(v Violation) bool { return v.Invariant == ProgressName }),
				"%+v", r.FirstViolations)
		})
	}
}

// TestShortLivenessTimeoutIsCaught seeds a bug in the modelled sweeper — a
// 10 s liveness timeout instead of 30 s — and sees I4 violated in a real
// run: a node whose session ended (a crash, a reset) is marked
// unreachable about 10 s after its last written hearing.
func TestShortLivenessTimeoutIsCaught(t *testing.T) {
	r := run(t, Config{Seed: "hasty", Nodes: 50, Duration: 10 * time.Minute, Settle: 2 * time.Minute, Chaos: ChaosHeavy,
		sweepTimeout: 10 * time.Second})
	require.Positive(t, r.Violations)
	require.True(t, slices.ContainsFunc(r.FirstViolations, func(v Violation) bool { return v.Invariant == "I4" }),
		"%+v", r.FirstViolations)
}

// TestShellQuote: the seed in the "reproduce with" line survives a POSIX
// shell as it is.
func TestShellQuote(t *testing.T) {
	seed := "a$HOME `id` it's\ttab\\"
	out, err := exec.Command("sh", "-c", "printf %s "+ShellQuote(seed)).Output()
	require.NoError(t, err)
	require.Equal(t, seed, string(out))
	r := &Report{Seed: seed, Nodes: 1, Chaos: ChaosNone, Violations: 1, duration: time.Minute}
	require.Contains(t, r.Err().Error(), "--seed "+ShellQuote(seed)+" --nodes 1 ")
}

func TestConfigErrors(t *testing.T) {
	for name, cfg := range map[string]Config{
		"no nodes":            {Nodes: 0, Duration: time.Minute},
		"too many nodes":      {Nodes: MaxNodes + 1, Duration: time.Minute},
		"no duration":         {Nodes: 1},
		"shorter than a beat": {Nodes: 1, Duration: WorkloadEvery - time.Millisecond},
		"too long":            {Nodes: 1, Duration: MaxDuration + time.Second},
		"negative settle":     {Nodes: 1, Duration: time.Minute, Settle: -time.Second},
		"too long a settle":   {Nodes: 1, Duration: time.Minute, Settle: MaxDuration + time.Second},
		"overflow":            {Nodes: 1, Duration: 2562047 * time.Hour, Settle: time.Hour},
		"unknown chaos":       {Nodes: 1, Duration: time.Minute, Chaos: "wild"},
	} {
		_, err := Run(cfg)
		require.ErrorIs(t, err, ErrConfig, name)
	}
}

// failingWriter fails every write.
type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

// TestLogWriteError: a failing log writer fails the run with ErrLog, but
// the run completes and its report (and digest) come back too.
func TestLogWriteError(t *testing.T) {
	cfg := Config{Seed: "log", Nodes: 5, Duration: time.Minute, Chaos: ChaosLight}
	r, err := Run(Config{Seed: cfg.Seed, Nodes: cfg.Nodes, Duration: cfg.Duration, Chaos: cfg.Chaos, Log: failingWriter{}})
	require.ErrorIs(t, err, ErrLog)
	require.ErrorContains(t, err, "disk full")
	require.NotNil(t, r)
	require.Equal(t, run(t, cfg).Digest, r.Digest)
}
