package agent_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/daemon"
)

// A non-UTC zone, so that time round trips are checked for real.
var (
	zone = time.FixedZone("UTC+5:30", 5*3600+1800)
	jt0  = time.Date(2030, 5, 6, 7, 8, 9, 123456789, zone)
)

func entry(id string, s gatewayv1.CommandState) daemon.Entry {
	return daemon.Entry{
		CommandID:  id,
		Kind:       "diag.nvml",
		RetrySafe:  true,
		State:      s,
		Deadline:   jt0.Add(time.Hour),
		ReceivedAt: jt0,
	}
}

func TestFileJournalRoundTrip(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	j, err := agent.OpenFileJournal(dir, jt0)
	require.NoError(t, err)
	require.True(t, j.LostAt().IsZero())
	require.Equal(t, uint64(1), j.Epoch())

	a := entry("cmd_a", gatewayv1.CommandState_COMMAND_STATE_RUNNING)
	a.Runs = 2
	require.NoError(t, j.Put(a))
	a.State = gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED
	a.FinishedAt = jt0.Add(time.Second)
	a.Result = &gatewayv1.CommandResult{Inventory: &gatewayv1.Inventory{Hostname: "h", Gpus: []*gatewayv1.Gpu{{Index: 1, Uuid: "GPU-x"}}}}
	require.NoError(t, j.Put(a))
	b := entry("cmd_b", gatewayv1.CommandState_COMMAND_STATE_FAILED)
	b.Error = "boom"
	require.NoError(t, j.Put(b))
	c := entry("cmd_c", gatewayv1.CommandState_COMMAND_STATE_EXPIRED)
	require.NoError(t, j.Put(c))
	d := entry("cmd_d", gatewayv1.CommandState_COMMAND_STATE_RUNNING)
	d.Runs, d.Interrupted = 1, daemon.ErrTextRebooted // waits to run again
	require.NoError(t, j.Put(d))
	require.NoError(t, j.Delete("cmd_b"))
	require.NoError(t, j.Delete("cmd_unknown"))
	require.NoError(t, j.Close())
	require.Error(t, j.Put(a), "closed")

	j2, err := agent.OpenFileJournal(dir, jt0.Add(time.Hour))
	require.NoError(t, err)
	t.Cleanup(func() { _ = j2.Close() })
	require.True(t, j2.LostAt().IsZero())
	got := j2.Entries()
	require.Len(t, got, 3)
	require.Equal(t, "cmd_a", got[0].CommandID)
	require.Equal(t, "cmd_c", got[1].CommandID)
	require.Equal(t, d.Runs, got[2].Runs)
	require.Equal(t, d.Interrupted, got[2].Interrupted)
	require.Equal(t, d.State, got[2].State)
	ga, ok := j2.Get("cmd_a")
	require.True(t, ok)
	require.Equal(t, a.State, ga.State)
	require.True(t, a.Deadline.Equal(ga.Deadline))
	require.True(t, a.FinishedAt.Equal(ga.FinishedAt))
	require.True(t, proto.Equal(a.Result, ga.Result))
	require.True(t, ga.RetrySafe)
	require.Equal(t, 2, ga.Runs)
	_, ok = j2.Get("cmd_b")
	require.False(t, ok)

	// A small journal is appended to as it is: one header line and one line
	// per Put or Delete.
	raw, err := os.ReadFile(filepath.Join(dir, agent.JournalFile))
	require.NoError(t, err)
	require.Equal(t, 7, strings.Count(string(raw), "\n"))
	for _, name := range []string{agent.JournalFile, agent.JournalEpochFile} {
		fi, err := os.Stat(filepath.Join(dir, name))
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	}
}

// A journal that never saw a command costs nothing on disk, and is not lost.
func TestFileJournalLazy(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for range 2 {
		j, err := agent.OpenFileJournal(dir, jt0)
		require.NoError(t, err)
		require.True(t, j.LostAt().IsZero())
		require.Equal(t, uint64(1), j.Epoch())
		require.Empty(t, j.Entries())
		require.NoError(t, j.Delete("cmd_unknown"))
		require.NoError(t, j.Close())
		des, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Empty(t, des)
	}
}

// Replaced and deleted entries are compacted away while the journal runs, so
// the file stays small, and what is read back is the live set.
func TestFileJournalCompacts(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	j, err := agent.OpenFileJournal(dir, jt0)
	require.NoError(t, err)
	keep := entry("cmd_keep", gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED)
	require.NoError(t, j.Put(keep))
	for i := range 500 {
		id := fmt.Sprintf("cmd_%03d", i)
		require.NoError(t, j.Put(entry(id, gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
		require.NoError(t, j.Put(entry(id, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED)))
		if i < 495 {
			require.NoError(t, j.Delete(id))
		}
	}
	require.NoError(t, j.Close())
	raw, err := os.ReadFile(filepath.Join(dir, agent.JournalFile))
	require.NoError(t, err)
	require.Less(t, strings.Count(string(raw), "\n"), 100)

	j2, err := agent.OpenFileJournal(dir, jt0.Add(time.Hour))
	require.NoError(t, err)
	t.Cleanup(func() { _ = j2.Close() })
	require.True(t, j2.LostAt().IsZero())
	require.Equal(t, uint64(1), j2.Epoch())
	var got []string
	for _, e := range j2.Entries() {
		require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, e.State)
		got = append(got, e.CommandID)
	}
	require.Equal(t, []string{"cmd_keep", "cmd_495", "cmd_496", "cmd_497", "cmd_498", "cmd_499"}, got)
}

// A crash during the first Put, before the journal was fsynced, leaves a
// torn file without a marker: the Put never returned, so nothing ran and
// nothing is lost. A crash after the fsync but before the marker leaves a
// whole journal, which is kept.
func TestFileJournalFirstPutCrash(t *testing.T) {
	t.Parallel()
	t.Run("torn", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(dir, agent.JournalFile), []byte(`{"v":1,"ep`), 0o600))
		j, err := agent.OpenFileJournal(dir, jt0)
		require.NoError(t, err)
		require.True(t, j.LostAt().IsZero())
		require.Empty(t, j.Entries())
		require.NoError(t, j.Put(entry("cmd_a", gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
		require.NoError(t, j.Close())
		j2, err := agent.OpenFileJournal(dir, jt0)
		require.NoError(t, err)
		t.Cleanup(func() { _ = j2.Close() })
		require.True(t, j2.LostAt().IsZero())
		require.Len(t, j2.Entries(), 1)
	})
	t.Run("unmarked", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		j, err := agent.OpenFileJournal(dir, jt0)
		require.NoError(t, err)
		require.NoError(t, j.Put(entry("cmd_a", gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
		require.NoError(t, j.Close())
		require.NoError(t, os.Remove(filepath.Join(dir, agent.JournalEpochFile)))
		j2, err := agent.OpenFileJournal(dir, jt0)
		require.NoError(t, err)
		require.True(t, j2.LostAt().IsZero())
		require.Len(t, j2.Entries(), 1)
		require.NoError(t, j2.Close())
		// The marker is back: losing the journal now is detected.
		require.FileExists(t, filepath.Join(dir, agent.JournalEpochFile))
		require.NoError(t, os.Remove(filepath.Join(dir, agent.JournalFile)))
		j3, err := agent.OpenFileJournal(dir, jt0.Add(time.Minute))
		require.NoError(t, err)
		t.Cleanup(func() { _ = j3.Close() })
		require.True(t, jt0.Add(time.Minute).Equal(j3.LostAt()))
	})
}

func TestFileJournalLoss(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		breakIt func(t *testing.T, dir string)
	}{
		{"deleted", func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, agent.JournalFile)))
		}},
		{"other epoch", func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, agent.JournalEpochFile), []byte("7\n"), 0o600))
		}},
		{"corrupt middle", func(t *testing.T, dir string) {
			path := filepath.Join(dir, agent.JournalFile)
			raw, err := os.ReadFile(path)
			require.NoError(t, err)
			lines := strings.Split(string(raw), "\n")
			lines[1] = "{not json"
			require.NoError(t, os.WriteFile(path, []byte(strings.Join(lines, "\n")), 0o600))
		}},
		{"empty", func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, agent.JournalFile), nil, 0o600))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			j, err := agent.OpenFileJournal(dir, jt0)
			require.NoError(t, err)
			require.NoError(t, j.Put(entry("cmd_a", gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
			require.NoError(t, j.Put(entry("cmd_b", gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
			require.NoError(t, j.Close())
			tc.breakIt(t, dir)

			lostAt := jt0.Add(time.Minute)
			j2, err := agent.OpenFileJournal(dir, lostAt)
			require.NoError(t, err)
			require.Empty(t, j2.Entries())
			require.True(t, lostAt.Equal(j2.LostAt()))
			require.Greater(t, j2.Epoch(), uint64(1))
			require.NoError(t, j2.Put(entry("cmd_c", gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
			require.NoError(t, j2.Close())

			// The loss is remembered by later opens.
			j3, err := agent.OpenFileJournal(dir, lostAt.Add(time.Hour))
			require.NoError(t, err)
			t.Cleanup(func() { _ = j3.Close() })
			require.True(t, lostAt.Equal(j3.LostAt()))
			require.Equal(t, j2.Epoch(), j3.Epoch())
			require.Len(t, j3.Entries(), 1)
		})
	}
}

func TestFileJournalTornTail(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	j, err := agent.OpenFileJournal(dir, jt0)
	require.NoError(t, err)
	require.NoError(t, j.Put(entry("cmd_a", gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED)))
	require.NoError(t, j.Close())
	f, err := os.OpenFile(filepath.Join(dir, agent.JournalFile), os.O_WRONLY|os.O_APPEND, 0o600)
	require.NoError(t, err)
	_, err = f.WriteString(`{"id":"cmd_b","kind":"diag`)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	// A Put that never returned is not a loss: the command never ran.
	j2, err := agent.OpenFileJournal(dir, jt0.Add(time.Minute))
	require.NoError(t, err)
	t.Cleanup(func() { _ = j2.Close() })
	require.True(t, j2.LostAt().IsZero())
	require.Len(t, j2.Entries(), 1)

	// The torn line is gone before anything is appended after it.
	require.NoError(t, j2.Put(entry("cmd_c", gatewayv1.CommandState_COMMAND_STATE_RUNNING)))
	require.NoError(t, j2.Close())
	j3, err := agent.OpenFileJournal(dir, jt0.Add(2*time.Minute))
	require.NoError(t, err)
	t.Cleanup(func() { _ = j3.Close() })
	require.True(t, j3.LostAt().IsZero())
	require.Len(t, j3.Entries(), 2)
}

// TestFileJournalReadsProtojsonResults: journals written before results were
// kept in binary hold them as protojson, and still load.
func TestFileJournalReadsProtojsonResults(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, agent.JournalFile), []byte(`{"v":1,"epoch":1}
{"id":"cmd_old","kind":"diag.nvml","retry_safe":true,"state":"COMMAND_STATE_SUCCEEDED","result":{"inventory":{"hostname":"old","gpus":[{"index":2,"uuid":"GPU-o","memoryBytes":"85899345920"}]}}}
`), 0o600))
	j, err := agent.OpenFileJournal(dir, jt0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = j.Close() })
	got, ok := j.Get("cmd_old")
	require.True(t, ok)
	want := &gatewayv1.CommandResult{Inventory: &gatewayv1.Inventory{Hostname: "old",
		Gpus: []*gatewayv1.Gpu{{Index: 2, Uuid: "GPU-o", MemoryBytes: 85899345920}}}}
	require.True(t, proto.Equal(want, got.Result), "got %v", got.Result)
}
