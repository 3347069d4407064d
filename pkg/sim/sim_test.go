package sim

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"runtime"
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
			require.Equal(t, int64((10*time.Minute+DefaultSettle)/time.Millisecond), r.SimulatedMs)
			kinds := []RecordKind{RecHeard, RecBookingStart, RecReleaseRequested, RecBookingEnd, RecNodeHolds,
				RecCommandCreated, RecExecuted, RecSpecDelivered, RecSpecObserved, RecUsageWindow}
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
// every command — and sees I2 violated.
func TestSkippedJournalIsCaught(t *testing.T) {
	r := run(t, Config{
		Seed: "forgetful", Nodes: 50, Duration: 10 * time.Minute, Settle: DefaultSettle, Chaos: ChaosHeavy,
		wrapJournal: func(j daemon.Journal) daemon.Journal { return forgetfulJournal{j} },
	})
	require.Positive(t, r.Violations)
	require.NotEmpty(t, r.FirstViolations)
	require.LessOrEqual(t, len(r.FirstViolations), MaxFirstViolations)
	require.Equal(t, "I2", r.FirstViolations[0].Invariant)
	require.Contains(t, r.FirstViolations[0].Detail, "again")
	err := r.Err()
	require.True(t, errors.Is(err, ErrInvariantViolated))
	require.True(t, strings.HasPrefix(err.Error(), "SIM_INVARIANT_VIOLATED: "), err.Error())
	require.Contains(t, err.Error(), "I2")
	require.Contains(t, err.Error(), `--seed "forgetful"`)
}

func TestConfigErrors(t *testing.T) {
	for name, cfg := range map[string]Config{
		"no nodes":        {Nodes: 0, Duration: time.Minute},
		"too many nodes":  {Nodes: MaxNodes + 1, Duration: time.Minute},
		"no duration":     {Nodes: 1},
		"negative settle": {Nodes: 1, Duration: time.Minute, Settle: -time.Second},
		"unknown chaos":   {Nodes: 1, Duration: time.Minute, Chaos: "wild"},
	} {
		_, err := Run(cfg)
		require.ErrorIs(t, err, ErrConfig, name)
	}
}
