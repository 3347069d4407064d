package cli_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// simReport is the JSON report of `better-compute sim`.
type simReport struct {
	Seed        string `json:"seed"`
	Nodes       int    `json:"nodes"`
	Chaos       string `json:"chaos"`
	SimulatedMs int64  `json:"simulatedMs"`
	WallMs      *int64 `json:"wallMs"`
	Digest      string `json:"digest"`
	Commands    struct {
		Total     int  `json:"total"`
		Open      *int `json:"open"`
		Succeeded *int `json:"succeeded"`
		Failed    *int `json:"failed"`
		Expired   *int `json:"expired"`
	} `json:"commands"`
	Faults struct {
		Crashes       *int `json:"crashes"`
		Reboots       *int `json:"reboots"`
		JournalLosses *int `json:"journalLosses"`
		GatewayKills  *int `json:"gatewayKills"`
	} `json:"faults"`
	Violations      *int              `json:"violations"`
	FirstViolations []json.RawMessage `json:"firstViolations"`
}

func TestSim(t *testing.T) {
	dir := t.TempDir()
	args := []string{"sim", "--seed", "cli", "--nodes", "30", "--duration", "2m", "--settle", "2m", "--chaos", "heavy"}
	run := func(log string) (simReport, result) {
		res := runner{}.run(t, append(args, "--log", log)...)
		require.Equal(t, 0, res.code, res.stderr)
		var r simReport
		require.NoError(t, json.Unmarshal([]byte(res.stdout), &r), res.stdout)
		return r, res
	}
	first := filepath.Join(dir, "first.log")
	r, _ := run(first)
	require.Equal(t, "cli", r.Seed)
	require.Equal(t, 30, r.Nodes)
	require.Equal(t, "heavy", r.Chaos)
	require.Equal(t, int64(4*60*1000), r.SimulatedMs)
	require.NotNil(t, r.WallMs)
	require.Equal(t, 2*60*3/2-3, r.Commands.Total)
	require.NotNil(t, r.Commands.Open)
	require.NotNil(t, r.Commands.Succeeded)
	require.NotNil(t, r.Commands.Failed)
	require.NotNil(t, r.Commands.Expired)
	require.Equal(t, r.Commands.Total, *r.Commands.Open+*r.Commands.Succeeded+*r.Commands.Failed+*r.Commands.Expired)
	require.Positive(t, *r.Commands.Succeeded)
	require.NotNil(t, r.Faults.Crashes)
	require.NotNil(t, r.Faults.Reboots)
	require.NotNil(t, r.Faults.JournalLosses)
	require.NotNil(t, r.Faults.GatewayKills)
	require.NotNil(t, r.Violations)
	require.Zero(t, *r.Violations)
	require.NotNil(t, r.FirstViolations)
	log, err := os.ReadFile(first)
	require.NoError(t, err)
	sum := sha256.Sum256(log)
	require.Equal(t, hex.EncodeToString(sum[:]), r.Digest, "the digest is SHA-256 of the event log")

	again, _ := run(filepath.Join(dir, "second.log"))
	require.Equal(t, r.Digest, again.Digest, "the same seed gives the same digest")

	// --log refuses an existing file and leaves it alone.
	res := runner{}.run(t, append(args, "--log", first)...)
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "exists")
	require.Empty(t, res.stdout)
	after, err := os.ReadFile(first)
	require.NoError(t, err)
	require.Equal(t, log, after)
}

func TestSimBadFlags(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		args []string
		want string // in stderr
	}{
		{[]string{"--nodes", "0"}, "--nodes"},
		{[]string{"--nodes", "5001"}, "--nodes"},
		{[]string{"--chaos", "wild"}, "--chaos"},
		{[]string{"--chaos", ""}, "--chaos: must not be empty"},
		{[]string{"--seed", ""}, "--seed: must not be empty"},
		{[]string{"--log", ""}, "--log: must not be empty"},
		{[]string{"--duration", "0s"}, "--duration"},
		{[]string{"--duration", "1s"}, "--duration: "},
		{[]string{"--duration", "2562047h", "--settle", "1h"}, "--duration: "},
		{[]string{"--duration", "169h"}, "at most 168h0m0s"},
		{[]string{"--settle", "169h"}, "--settle: "},
		{[]string{"--settle", "-1s"}, "--settle"},
		{[]string{"extra"}, ""},
	} {
		// A bad flag never leaves a log file behind.
		log := filepath.Join(dir, "t.log")
		args := append([]string{"sim", "--log", log}, c.args...)
		res := runner{}.run(t, args...)
		require.Equal(t, 1, res.code, "%v", args)
		require.Contains(t, res.stderr, "error: ", "%v", args)
		require.Contains(t, res.stderr, c.want, "%v", args)
		require.Empty(t, res.stdout, "%v", args)
		require.NoFileExists(t, log, "%v", args)
	}
}

func TestSimHelpListsInvariants(t *testing.T) {
	res := runner{}.run(t, "sim", "--help")
	require.Equal(t, 0, res.code)
	require.Contains(t, res.stdout, "168h0m0s")
	require.Contains(t, res.stdout, "only the stub's own bookkeeping")
	for _, inv := range []string{"I1: ", "I2: ", "I3: ", "I4: ", "I5: ", "I8: ", "progress: "} {
		require.Contains(t, res.stdout, "\n  "+inv)
	}
}
