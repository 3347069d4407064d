package cli_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
)

type commandOut struct {
	ID        string `json:"id"`
	NodeID    string `json:"node"`
	Kind      string `json:"kind"`
	State     string `json:"state"`
	RetrySafe bool   `json:"retrySafe"`
	Error     string `json:"error"`
	RequestID string `json:"requestId"`
	Deadline  string `json:"deadline"`
}

func parseCommand(t *testing.T, out string) commandOut {
	t.Helper()
	var c commandOut
	require.NoError(t, json.Unmarshal([]byte(out), &c), out)
	return c
}

// TestCommands runs, gets and lists commands, waits for one to finish, and
// checks the refusals.
func TestCommands(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := runner{env: map[string]string{"BETTER_COMPUTE_URL": f.url, "BETTER_COMPUTE_TOKEN": f.root}, clk: clock.New()}

	before := clock.New().Now()
	res := r.run(t, "commands", "run", "--node", f.adopted, "node.reboot", "--timeout", "90s", "--request-id", "rb-1")
	require.Equal(t, 0, res.code, res.stderr)
	reboot := parseCommand(t, res.stdout)
	require.Equal(t, "queued", reboot.State)
	require.Equal(t, f.adopted, reboot.NodeID)
	require.False(t, reboot.RetrySafe)
	deadline, err := time.Parse(time.RFC3339Nano, reboot.Deadline)
	require.NoError(t, err)
	require.WithinDuration(t, before.Add(90*time.Second), deadline, 10*time.Second)
	res = r.run(t, "commands", "run", "--node", f.adopted, "node.reboot", "--request-id", "rb-1")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, reboot.ID, parseCommand(t, res.stdout).ID, "a retry returns the same command")

	res = r.run(t, "commands", "get", reboot.ID)
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, "node.reboot", parseCommand(t, res.stdout).Kind)

	// --wait: the node reports a failure while the CLI polls.
	go func() {
		for range 200 {
			var id string
			err := f.db.Pool.QueryRow(t.Context(), `SELECT id FROM commands WHERE kind = 'logs.collect'`).Scan(&id)
			if err == nil {
				_ = f.db.InTx(t.Context(), func(tx pgx.Tx) error {
					_, err := store.ApplySessionCommandUpdates(t.Context(), tx, []store.SessionCommandUpdate{{NodeID: f.adopted,
						CommandID: id, State: "failed", Error: "disk full", Now: f.db.Now()}})
					return err
				})
				return
			}
			if clock.Sleep(t.Context(), clock.New(), 20*time.Millisecond) != nil {
				return
			}
		}
	}()
	res = r.run(t, "commands", "run", "--node", f.adopted, "logs.collect", "--wait")
	require.Equal(t, 1, res.code, res.stdout)
	logs := parseCommand(t, res.stdout)
	require.Equal(t, "failed", logs.State)
	require.Contains(t, res.stderr, "command "+logs.ID+" failed: disk full")

	res = r.run(t, "commands", "list", "--node", f.adopted)
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Len(t, lines, 3, res.stdout)
	require.Equal(t, []string{"ID", "NODE", "KIND", "STATE", "DELIVERIES", "CREATED", "ERROR"}, strings.Fields(lines[0]))
	require.Equal(t, []string{logs.ID, f.adopted, "logs.collect", "failed", "0"}, strings.Fields(lines[1])[:5])
	require.Equal(t, []string{reboot.ID, f.adopted, "node.reboot", "queued", "0"}, strings.Fields(lines[2])[:5])
	res = r.run(t, "commands", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var listed []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &listed))
	require.Len(t, listed, 2)

	// Refusals.
	res = r.run(t, "commands", "run", "--node", f.adopted, "rm-rf")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, `unknown command kind "rm-rf"`)
	res = r.run(t, "commands", "run", "--node", f.joining, "diag.nvml")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "is not adopted (it is joining)")
	res = r.run(t, "commands", "run", "diag.nvml")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, `"node" not set`)
	res = f.runner(f.viewer).run(t, "commands", "run", "--node", f.adopted, "diag.nvml")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, "needs commands.run")
	res = f.runner(f.viewer).run(t, "commands", "list")
	require.Equal(t, 0, res.code, res.stderr)
}

// TestCommandsRunWaitRidesOutAnOutage: `commands run --wait` keeps polling
// through an API that cannot answer for a while (the command goes on without
// it) and reports the command's end, not the outage.
func TestCommandsRunWaitRidesOutAnOutage(t *testing.T) {
	t.Parallel()
	id, res := runWaitThrough(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"code":"unavailable","message":"the api is restarting"}`))
	})
	require.Contains(t, res.stderr, "commands run: waiting for "+id+": unavailable: the api is restarting; retrying")
}

// TestCommandsRunWaitRidesOutLostConnections: a connection that drops in the
// middle of a response (the API was killed) is a transient failure too, and
// reads as one: "unavailable: lost the connection to the API server".
func TestCommandsRunWaitRidesOutLostConnections(t *testing.T) {
	t.Parallel()
	id, res := runWaitThrough(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/proto")
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte{0x0a, 0x02})
		http.NewResponseController(w).Flush() //nolint:errcheck // the client sees what was written
		panic(http.ErrAbortHandler)           // drop the connection
	})
	require.Contains(t, res.stderr, "commands run: waiting for "+id+
		": unavailable: lost the connection to the API server: read message: unexpected EOF; retrying")
}

// runWaitThrough runs `commands run --wait` through a proxy of a fleet's API
// that answers its first three GetCommand calls with fail, then lets the
// command succeed; it checks that the command waited for the success and
// returns its id and the command's result.
func runWaitThrough(t *testing.T, fail http.HandlerFunc) (string, result) {
	t.Helper()
	f := newFleet(t)
	target, err := url.Parse(f.url)
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	var refused atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/GetCommand") && refused.Add(1) <= 3 {
			fail(w, r)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	r := runner{env: map[string]string{"BETTER_COMPUTE_URL": srv.URL, "BETTER_COMPUTE_TOKEN": f.root}, clk: clock.New()}

	go func() {
		for refused.Load() <= 3 {
			if clock.Sleep(t.Context(), clock.New(), 20*time.Millisecond) != nil {
				return
			}
		}
		var id string
		if f.db.Pool.QueryRow(t.Context(), `SELECT id FROM commands WHERE kind = 'inventory.refresh'`).Scan(&id) != nil {
			return
		}
		_ = f.db.InTx(t.Context(), func(tx pgx.Tx) error {
			_, err := store.ApplySessionCommandUpdates(t.Context(), tx, []store.SessionCommandUpdate{{NodeID: f.adopted,
				CommandID: id, State: "succeeded", Now: f.db.Now()}})
			return err
		})
	}()
	res := r.run(t, "commands", "run", "--node", f.adopted, "inventory.refresh", "--wait")
	require.Equal(t, 0, res.code, res.stderr)
	cmd := parseCommand(t, res.stdout)
	require.Equal(t, "succeeded", cmd.State)
	return cmd.ID, res
}

// TestCommandsRunTimeout: --timeout 0 or negative is refused by the CLI
// naming the flag (it used to mean the 5m default), and queues nothing; a
// timeout out of the API's range is the API's invalid_argument naming the
// field.
func TestCommandsRunTimeout(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	for _, d := range []string{"0", "0s", "-1s", "-5m"} {
		res := r.run(t, "commands", "run", "--node", f.adopted, "diag.nvml", "--timeout", d)
		require.Equal(t, 1, res.code, "--timeout %s: %s", d, res.stdout)
		require.Contains(t, res.stderr, "error: --timeout must be positive (1s to 24h; leave it out for 5m), got ", d)
		require.Empty(t, res.stdout)
	}
	for _, d := range []string{"500ms", "25h"} {
		res := r.run(t, "commands", "run", "--node", f.adopted, "diag.nvml", "--timeout", d)
		require.Equal(t, 1, res.code, "--timeout %s: %s", d, res.stdout)
		require.Contains(t, res.stderr, "error: invalid_argument: ", d)
		require.Contains(t, res.stderr, "timeout", d)
	}
	var n int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM commands`).Scan(&n))
	require.Zero(t, n, "a refused timeout queued a command")

	res := r.run(t, "commands", "run", "--node", f.adopted, "diag.nvml")
	require.Equal(t, 0, res.code, res.stderr)
	c := parseCommand(t, res.stdout)
	deadline, err := time.Parse(time.RFC3339Nano, c.Deadline)
	require.NoError(t, err)
	require.WithinDuration(t, clock.New().Now().Add(5*time.Minute), deadline, time.Minute, "unset: the 5m default")
}
