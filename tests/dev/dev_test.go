// Package dev_test drives `better-compute dev` as a user does: the built
// binary (bin/linux/better-compute, `make build`) as a subprocess in a
// working directory of its own, then the CLI with the environment dev wrote
// to .better-compute/dev.env. Run as root (as CI does), the embedded
// PostgreSQL server runs as an unprivileged user, and these tests check so.
package dev_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/tests/internal/containers"
	"github.com/better-compute/better-compute/tests/internal/devproc"
	"github.com/better-compute/better-compute/tests/internal/procs"
	"github.com/better-compute/better-compute/tests/internal/tunneltest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	containers.Stop()
	os.Exit(code)
}

// node is one element of `nodes list -o json`.
type node struct {
	ID    string `json:"id"`
	Pool  string `json:"pool"`
	State string `json:"state"`
	GPUs  int    `json:"gpus"`
	Model string `json:"model"`
}

func nodes(t *testing.T, d *devproc.Dev) []node {
	t.Helper()
	var nodes []node
	out := d.CLI("nodes", "list", "-o", "json")
	require.NoError(t, json.Unmarshal([]byte(out), &nodes), out)
	return nodes
}

const adoptWithin = 90 * time.Second

// TestDevMemorySim8 is the documentation's laptop walkthrough: dev --memory
// --sim 8 on a free port, then as the root administrator list the 8
// adopted nodes, offer the pool, reserve 4 GPUs (active, with CDI names),
// open tunnels to the reservation's node (console, ssh; tunneltest.Exercise),
// watch node.* events while cordoning a node, join a machine from outside
// with the pins dev wrote; SIGTERM stops everything and leaves no process.
func TestDevMemorySim8(t *testing.T) {
	t.Parallel()
	began := devproc.Wall.Now()
	d := devproc.Start(t, "", nil, "--memory", "--sim", "8", "--port", "0")
	url := d.WaitLine(`^better-compute listening on (http://127\.0\.0\.1:\d+)/api/compute$`, 30*time.Second)[1]
	d.WaitLine(`^Gateway \(mTLS, loopback\): https://127\.0\.0\.1:\d+$`, time.Second)
	root := d.WaitLine(`^Root tenant (ten_\w+); root token \(dev only\): (bct_[\w-]+)$`, time.Second)
	pool := d.WaitLine(`^Joined 8 simulated hgx-h100 node\(s\) into (pool_\w+)$`, adoptWithin)[1]
	d.WaitLine(`^8 simulated node\(s\) adopted$`, adoptWithin)
	t.Logf("dev --memory --sim 8: 8 adopted %s after launch", clock.Since(devproc.Wall, began).Round(time.Millisecond))
	require.Equal(t, []string{"BETTER_COMPUTE_URL=" + url, "BETTER_COMPUTE_TOKEN=" + root[2], "BETTER_COMPUTE_TENANT=" + root[1],
		"BETTER_COMPUTE_POOL=" + pool}, d.Env())

	// The embedded PostgreSQL server is dev's child, unprivileged when dev
	// runs as root.
	kids := devproc.Children(t, d.PID())
	require.NotEmpty(t, kids, "the embedded PostgreSQL server runs")
	for _, pid := range kids {
		if os.Geteuid() == 0 {
			require.NotZero(t, devproc.UID(t, pid), "postgres (pid %d) runs as an unprivileged user", pid)
		} else {
			require.Equal(t, os.Geteuid(), devproc.UID(t, pid))
		}
	}

	all := nodes(t, d)
	require.Len(t, all, 8)
	for _, n := range all {
		require.Equal(t, "adopted", n.State)
		require.Equal(t, pool, n.Pool)
		require.Equal(t, 8, n.GPUs)
		require.Contains(t, n.Model, "H100")
	}

	d.CLI("pools", "offer", pool, "--to", root[1], "--quota", "gpu=64")
	out := d.CLI("reserve", "--pool", pool, "--gpus", "4", "--for", "1h", "--wait", "--timeout", "60s")
	var r struct {
		ID      string   `json:"id"`
		State   string   `json:"state"`
		NodeID  string   `json:"nodeId"`
		Binding []string `json:"binding"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &r), out)
	require.Equal(t, "active", r.State, out)
	require.Len(t, r.Binding, 4, out)
	for _, name := range r.Binding {
		require.Regexp(t, `^nvidia\.com/gpu=[0-7]$`, name)
	}

	other := all[0].ID
	if other == r.NodeID {
		other = all[1].ID
	}
	tunneltest.Exercise(t, tunneltest.Scenario{CLI: tunneltest.CLI{Path: procs.Binary(t, "better-compute"),
		Env: append(os.Environ(), d.Env()...)}, Node: r.NodeID, Other: other, Reservation: r.ID})

	watchCordon(t, d, all[0].ID)
	outsideMachine(t, d, url, pool)

	pg := devproc.Descendants(t, d.PID())
	require.NotEmpty(t, pg)
	require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Stderr())
	devproc.RequireGone(t, pg)
	_, err := os.Stat(filepath.Join(d.Dir, ".better-compute", "dev-db"))
	require.ErrorIs(t, err, os.ErrNotExist, "--memory keeps no data")
}

// watchCordon runs `events watch --types node.*`, cordons nodeID from
// another process and waits for the watch to print node.cordoned.
func watchCordon(t *testing.T, d *devproc.Dev, nodeID string) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	watch := exec.CommandContext(ctx, procs.Binary(t, "better-compute"), "events", "watch", "--types", "node.*")
	watch.Env = append(os.Environ(), d.Env()...)
	out, err := watch.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, watch.Start())
	defer func() { cancel(); _ = watch.Wait() }()
	type event struct {
		Type      string `json:"type"`
		SubjectID string `json:"subjectId"`
	}
	events := make(chan event, 64)
	go func() {
		defer close(events)
		dec := json.NewDecoder(out)
		for {
			var e event
			if dec.Decode(&e) != nil {
				return
			}
			events <- e
		}
	}()
	// The watch starts from now: let it subscribe first, as a person
	// switching terminals would.
	require.NoError(t, clock.Sleep(ctx, devproc.Wall, time.Second))
	began := devproc.Wall.Now()
	d.CLI("nodes", "cordon", nodeID, "--reason", "demo")
	timer := devproc.Wall.NewTimer(10 * time.Second)
	defer timer.Stop()
	for {
		select {
		case e, ok := <-events:
			require.True(t, ok, "events watch ended")
			if e.Type == "node.cordoned" && e.SubjectID == nodeID {
				t.Logf("events watch printed node.cordoned %s after the cordon (target: 1 s)", clock.Since(devproc.Wall, began).Round(time.Millisecond))
				return
			}
		case <-timer.C():
			t.Fatalf("events watch printed no node.cordoned for %s", nodeID)
		}
	}
}

// outsideMachine joins one fakedaemon process with --server and the pins
// dev wrote to .better-compute/dev-pins.json, and waits for its adoption.
func outsideMachine(t *testing.T, d *devproc.Dev, url, pool string) {
	secret := strings.TrimSpace(d.CLI("join-tokens", "create", "--pool", pool, "--max-uses", "1"))
	require.True(t, strings.HasPrefix(secret, "bcjt_"), secret)
	procs.Launch(t, "fakedaemon", []string{"--server", url, "--pins-file", filepath.Join(d.Dir, ".better-compute", "dev-pins.json"),
		"--data-dir", t.TempDir(), "--health-listen", procs.FreeAddr(t)}, "BETTER_COMPUTE_JOIN_TOKEN="+secret)
	require.Eventually(t, func() bool {
		adopted := 0
		for _, n := range nodes(t, d) {
			if n.State == "adopted" {
				adopted++
			}
		}
		return adopted == 9
	}, adoptWithin, 200*time.Millisecond, "the outside machine is adopted too")
}

// TestDevVariants: each --sim-variant gets the pool that fits it; the GPU
// missing variant fails acceptance with the reason.
func TestDevVariants(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ variant, line string }{
		{"l40s", `^2 simulated node\(s\) adopted$`},
		{"cpu", `^2 simulated node\(s\) adopted$`},
		{"hgx-h100-gpu-missing", `^2 simulated node\(s\) failed acceptance: expected 8 GPUs, found 7$`},
	} {
		t.Run(c.variant, func(t *testing.T) {
			t.Parallel()
			d := devproc.Start(t, "", nil, "--memory", "--sim", "2", "--sim-variant", c.variant, "--port", "0")
			d.WaitLine(`^Joined 2 simulated `+regexp.QuoteMeta(c.variant)+` node\(s\) into pool_\w+$`, adoptWithin)
			d.WaitLine(c.line, adoptWithin)
			require.Equal(t, 0, d.Stop(syscall.SIGINT), d.Stderr())
		})
	}
}

// TestDevKeptData: runs on one --data keep the same root token, pool and
// nodes; a run comes back without a new join, also after the one before it
// was killed (SIGKILL: its embedded PostgreSQL server left as a crash
// leaves it); a run without --sim warns that the kept machines are not
// started.
func TestDevKeptData(t *testing.T) {
	t.Parallel()
	dir := devproc.WorkDir(t)
	data := filepath.Join(dir, "kept")
	run := func(sig syscall.Signal) (token string, ids []string) {
		d := devproc.Start(t, dir, nil, "--data", data, "--sim", "2", "--port", "0")
		token = d.WaitLine(`^Root tenant ten_\w+; root token \(dev only\): (bct_[\w-]+)$`, 30*time.Second)[1]
		d.WaitLine(`^2 simulated node\(s\) adopted$`, adoptWithin)
		for _, n := range nodes(t, d) {
			ids = append(ids, n.ID)
		}
		pg := devproc.Descendants(t, d.PID())
		require.NotEmpty(t, pg)
		code := d.Stop(sig)
		if sig == syscall.SIGTERM {
			require.Equal(t, 0, code, d.Stderr())
		}
		devproc.RequireGone(t, pg)
		return token, ids
	}
	token1, nodes1 := run(syscall.SIGTERM)
	token2, nodes2 := run(syscall.SIGKILL)
	token3, nodes3 := run(syscall.SIGTERM)

	// Without --sim the kept machines stay off, and dev says so (a
	// warning, on standard error; the startup text is standard output).
	d := devproc.Start(t, dir, nil, "--data", data, "--port", "0")
	d.WaitLine(`^warning: `+regexp.QuoteMeta(data)+` holds 2 simulated machine\(s\) of an earlier run, not started: pass --sim 2 to start them$`,
		30*time.Second)
	d.WaitLine(`^CLI environment: source \.better-compute/dev\.env$`, 30*time.Second)
	require.Contains(t, d.Stderr(), "pass --sim 2")
	require.Contains(t, d.Stdout(), "better-compute listening on ")
	require.Contains(t, d.Stdout(), "Root tenant ")
	require.NotContains(t, d.Stderr(), "better-compute listening on ")
	require.NotContains(t, d.Stdout(), "warning: ")
	require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Output())

	require.Len(t, nodes1, 2)
	for _, run := range []struct {
		token string
		nodes []string
	}{{token2, nodes2}, {token3, nodes3}} {
		require.Equal(t, token1, run.token, "the root token is kept")
		require.ElementsMatch(t, nodes1, run.nodes, "the machines come back as the same nodes")
	}
	st, err := os.Stat(data)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
}

// TestDevExternalDatabase: with a configuration file (or
// BETTER_COMPUTE_DATABASE_URL) naming a database, dev migrates and uses it
// and starts no PostgreSQL server of its own.
func TestDevExternalDatabase(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"config", "env"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			url := containers.Postgres(t)
			dir := devproc.WorkDir(t)
			var env []string
			if how == "config" {
				require.NoError(t, os.WriteFile(filepath.Join(dir, "deploy.env"),
					[]byte("# the deployment's database\nBETTER_COMPUTE_DATABASE_URL="+url+"\n"), 0o600))
				env = []string{"BETTER_COMPUTE_CONFIG=deploy.env"}
			} else {
				env = []string{"BETTER_COMPUTE_DATABASE_URL=" + url}
			}
			d := devproc.Start(t, dir, env, "--sim", "2", "--port", "0")
			d.WaitLine(`^2 simulated node\(s\) adopted$`, adoptWithin)
			require.Empty(t, devproc.Descendants(t, d.PID()), "no embedded PostgreSQL server")
			db, err := pgx.Connect(t.Context(), url)
			require.NoError(t, err)
			defer db.Close(context.Background())
			var adopted int
			require.NoError(t, db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE provision_state = 'adopted'`).Scan(&adopted))
			require.Equal(t, 2, adopted, "the nodes are in the configured database")
			require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Stderr())
			_, err = os.Stat(filepath.Join(dir, ".better-compute", "dev-db", "postgres"))
			require.ErrorIs(t, err, os.ErrNotExist, "no embedded cluster was made")
		})
	}
}

// TestDevBadInput: each bad flag, environment or directory exits non-zero
// with one line naming it, and leaves no directory and no process.
func TestDevBadInput(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { busy.Close() }) // after the parallel subtests
	busyPort := strconv.Itoa(busy.Addr().(*net.TCPAddr).Port)
	for _, c := range []struct {
		name  string
		args  []string
		env   []string
		setup func(t *testing.T, dir string)
		want  string
	}{
		{name: "negative sim", args: []string{"--sim", "-1"}, want: "--sim: -1 is out of range (0 to 10000)"},
		{name: "too many sim", args: []string{"--sim", "10001"}, want: "--sim: 10001 is out of range (0 to 10000)"},
		{name: "unknown variant", args: []string{"--sim-variant", "tpu"}, want: `--sim-variant: unknown variant "tpu"`},
		{name: "memory and data", args: []string{"--memory", "--data", "x"}, want: "--memory and --data cannot be used together"},
		{name: "port out of range", args: []string{"--port", "70000"}, want: "--port: 70000 is not a port (0 to 65535)"},
		{name: "port in use", args: []string{"--port", busyPort}, want: "--port: 127.0.0.1:" + busyPort + " is already in use"},
		{name: "PORT not a number", env: []string{"PORT=http"}, want: `PORT: "http" is not a port number`},
		{name: "missing config", args: []string{"--config", "nope.env"}, want: "--config: nope.env does not exist"},
		{name: "config does not parse", args: []string{"--config", "bad.env"}, want: "--config: bad.env:2: want KEY=VALUE",
			setup: func(t *testing.T, dir string) {
				require.NoError(t, os.WriteFile(filepath.Join(dir, "bad.env"), []byte("# dev\nnot a setting\n"), 0o600))
			}},
		{name: "config unknown setting", env: []string{"BETTER_COMPUTE_CONFIG=odd.env"}, want: "BETTER_COMPUTE_CONFIG: odd.env:1: unknown setting BETTER_COMPUTE_FOO",
			setup: func(t *testing.T, dir string) {
				require.NoError(t, os.WriteFile(filepath.Join(dir, "odd.env"), []byte("BETTER_COMPUTE_FOO=1\n"), 0o600))
			}},
		{name: "data not creatable", args: []string{"--data", "/proc/better-compute-dev"}, want: "--data: /proc/better-compute-dev cannot be created"},
		{name: "data is a file", args: []string{"--data", "file"}, want: "--data: file is not a directory",
			setup: func(t *testing.T, dir string) {
				require.NoError(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o600))
			}},
		{name: "data holds something else", args: []string{"--data", "photos"}, want: "--data: photos holds files that are not a better-compute dev stack's",
			setup: func(t *testing.T, dir string) {
				require.NoError(t, os.Mkdir(filepath.Join(dir, "photos"), 0o700))
				require.NoError(t, os.WriteFile(filepath.Join(dir, "photos", "cat.jpg"), []byte("meow"), 0o600))
			}},
		{name: "no postgres binaries", env: []string{"BETTER_COMPUTE_POSTGRES_BIN=/nonexistent"}, want: "BETTER_COMPUTE_POSTGRES_BIN"},
		{name: "state dir is a file", want: ".better-compute is not a directory",
			setup: func(t *testing.T, dir string) {
				require.NoError(t, os.WriteFile(filepath.Join(dir, ".better-compute"), nil, 0o600))
			}},
		{name: "log level", env: []string{"BETTER_COMPUTE_LOG_LEVEL=loud"}, want: `BETTER_COMPUTE_LOG_LEVEL: want debug, info, warn or error, got "loud"`},
		{name: "missing PKI dir", env: []string{"BETTER_COMPUTE_PKI_DIR=/nonexistent/pki"}, want: "BETTER_COMPUTE_PKI_DIR: /nonexistent/pki is not a directory"},
		{name: "signed intent not a bool", args: []string{"--config", "si.env"}, want: `si.env:1: BETTER_COMPUTE_SIGNED_INTENT: want true or false, got "maybe"`,
			setup: func(t *testing.T, dir string) {
				require.NoError(t, os.WriteFile(filepath.Join(dir, "si.env"), []byte("BETTER_COMPUTE_SIGNED_INTENT=maybe\n"), 0o600))
			}},
		{name: "NATS unreachable", args: []string{"--memory"}, env: []string{"BETTER_COMPUTE_NATS_URL=nats://127.0.0.1:1"},
			want: "BETTER_COMPUTE_NATS_URL: cannot reach the NATS server"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := devproc.WorkDir(t)
			if c.setup != nil {
				c.setup(t, dir)
			}
			before := listing(t, dir)
			args := c.args
			if len(c.env) == 0 || !strings.HasPrefix(c.env[0], "PORT=") {
				args = append([]string{"--port", "0"}, args...) // no clash with whatever holds 3000
			}
			d := devproc.Start(t, dir, c.env, args...)
			require.Equal(t, 1, d.Wait(time.Minute), d.Stderr())
			lines := strings.Split(strings.TrimSpace(d.Stderr()), "\n")
			require.Len(t, lines, 1, "one line: %q", d.Stderr())
			require.Contains(t, lines[0], c.want)
			require.Equal(t, before, listing(t, dir), "nothing left behind")
		})
	}
}

// listing returns the paths under dir.
func listing(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	require.NoError(t, filepath.WalkDir(dir, func(path string, _ os.DirEntry, err error) error {
		out = append(out, path)
		return err
	}))
	return out
}

// TestDevKilledWhileStarting: dev killed (SIGKILL) at any moment of its
// first start, during initdb or migrations, leaves a --data that the next
// run starts from without help.
func TestDevKilledWhileStarting(t *testing.T) {
	t.Parallel()
	dir := devproc.WorkDir(t)
	data := filepath.Join(dir, "kept")
	// initdb and the migrations take the first ~0.6 s: kill throughout.
	for after := 50 * time.Millisecond; after <= 900*time.Millisecond; after += 75 * time.Millisecond {
		d := devproc.Start(t, dir, nil, "--data", data, "--port", "0")
		require.NoError(t, clock.Sleep(t.Context(), devproc.Wall, after))
		pg := devproc.Descendants(t, d.PID())
		d.Stop(syscall.SIGKILL)
		devproc.RequireGone(t, pg)
	}
	d := devproc.Start(t, dir, nil, "--data", data, "--sim", "2", "--port", "0")
	d.WaitLine(`^2 simulated node\(s\) adopted$`, adoptWithin)
	require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Stderr())
}

// TestDevTwoAtOnce: two devs started at once on a new --data: one runs, the
// other is refused, and the refused one leaves the winner's data alone.
func TestDevTwoAtOnce(t *testing.T) {
	t.Parallel()
	dir := devproc.WorkDir(t)
	data := filepath.Join(dir, "shared")
	a := devproc.Start(t, dir, nil, "--data", data, "--port", "0")
	b := devproc.Start(t, dir, nil, "--data", data, "--port", "0")
	var winner, loser *devproc.Dev
	for winner == nil {
		select {
		case <-a.Done():
			winner, loser = b, a
		case <-b.Done():
			winner, loser = a, b
		case <-devproc.Wall.NewTimer(time.Minute).C():
			t.Fatalf("neither dev was refused:\n%s\n---\n%s", a.Stderr(), b.Stderr())
		}
	}
	require.Equal(t, 1, loser.Wait(time.Second), loser.Stderr())
	require.Contains(t, loser.Stderr(), "--data: "+data+" is in use by another better-compute dev stack (pid ")
	winner.WaitLine(`^CLI environment: source \.better-compute/dev\.env$`, 30*time.Second)
	require.NotEmpty(t, winner.CLI("pools", "list"), "the winner's data is intact")
	require.Equal(t, 0, winner.Stop(syscall.SIGTERM), winner.Stderr())
}

// TestDevHangupAndBrokenPipe: a closed terminal (SIGHUP) stops dev as
// SIGTERM does, and so does SIGTERM after the reader of its standard output
// (`dev | tee`) went away: the embedded server and its directory are gone afterwards.
func TestDevHangupAndBrokenPipe(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name       string
		closePipe  bool
		sig        syscall.Signal
		wantStderr bool
	}{
		{"hangup", false, syscall.SIGHUP, true},
		{"broken pipe", true, syscall.SIGTERM, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			d := devproc.Start(t, "", nil, "--memory", "--port", "0")
			d.WaitLine(`^CLI environment: `, 30*time.Second)
			pg := devproc.Descendants(t, d.PID())
			require.NotEmpty(t, pg)
			shm := devproc.DataDirOf(t, pg[0])
			require.DirExists(t, shm)
			if c.closePipe {
				d.CloseStdout()
			}
			code := d.Stop(c.sig)
			require.Equal(t, 0, code, d.Stderr())
			if c.wantStderr {
				require.Contains(t, d.Stdout(), "stopping")
			}
			devproc.RequireGone(t, pg)
			require.NoDirExists(t, filepath.Dir(shm), "the in-memory cluster is removed")
		})
	}
}

// TestDevRevokedMachineIsReported: a restart whose machine's node was
// revoked says so rather than that every machine was adopted.
func TestDevRevokedMachineIsReported(t *testing.T) {
	t.Parallel()
	dir := devproc.WorkDir(t)
	data := filepath.Join(dir, "kept")
	d := devproc.Start(t, dir, nil, "--data", data, "--sim", "2", "--port", "0")
	d.WaitLine(`^2 simulated node\(s\) adopted$`, adoptWithin)
	victim := nodes(t, d)[0].ID
	d.CLI("nodes", "revoke", victim, "--reason", "test")
	require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Stderr())

	d = devproc.Start(t, dir, nil, "--data", data, "--sim", "2", "--port", "0")
	d.WaitLine(`^warning: .*node `+victim+`'s machine stopped for good`, adoptWithin)
	require.NotContains(t, d.Output(), "2 simulated node(s) adopted")
	require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Stderr())
}

// TestDevSecondInSameDirectory: a second dev in one working directory
// prints its environment instead of taking over dev.env, which keeps naming
// the first; once the first stops, the second takes dev.env over.
func TestDevSecondInSameDirectory(t *testing.T) {
	t.Parallel()
	dir := devproc.WorkDir(t)
	first := devproc.Start(t, dir, nil, "--memory", "--port", "0")
	url1 := first.WaitLine(`^better-compute listening on (\S+)/api/compute$`, 30*time.Second)[1]
	first.WaitLine(`^CLI environment: `, 5*time.Second)
	second := devproc.Start(t, dir, nil, "--memory", "--port", "0")
	url2 := second.WaitLine(`^better-compute listening on (\S+)/api/compute$`, 30*time.Second)[1]
	second.WaitLine(`^Another better-compute dev \(pid \d+\) owns \.better-compute/dev\.env in this directory; this one's CLI environment:$`, 5*time.Second)
	second.WaitLine(`^export BETTER_COMPUTE_URL=`+regexp.QuoteMeta(url2)+`$`, 5*time.Second)
	require.Contains(t, first.Env(), "BETTER_COMPUTE_URL="+url1)

	require.Equal(t, 0, first.Stop(syscall.SIGTERM), first.Stderr())
	second.WaitLine(`^CLI environment: source \.better-compute/dev\.env \(the dev that had it stopped\)$`, 10*time.Second)
	require.Contains(t, second.Env(), "BETTER_COMPUTE_URL="+url2)
	require.NotEmpty(t, second.CLI("nodes", "list"))
	require.Equal(t, 0, second.Stop(syscall.SIGTERM), second.Stderr())
}

// TestDevInterruptedJoinLeavesNoGhosts: dev stopped while its machines
// join, then run again, has exactly its machines as nodes, all adopted: a
// machine stopped mid-join comes back as the node its first Join made.
func TestDevInterruptedJoinLeavesNoGhosts(t *testing.T) {
	t.Parallel()
	dir := devproc.WorkDir(t)
	data := filepath.Join(dir, "kept")
	const n = 200
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGKILL} {
		d := devproc.Start(t, dir, nil, "--data", data, "--sim", strconv.Itoa(n), "--port", "0")
		d.WaitLine(`^Root tenant `, 30*time.Second)
		require.NoError(t, clock.Sleep(t.Context(), devproc.Wall, 300*time.Millisecond)) // the machines are joining
		d.Stop(sig)
	}
	d := devproc.Start(t, dir, nil, "--data", data, "--sim", strconv.Itoa(n), "--port", "0")
	d.WaitLine(fmt.Sprintf(`^%d simulated node\(s\) adopted$`, n), adoptWithin)
	states := map[string]int{}
	for _, node := range nodes(t, d) {
		states[node.State]++
	}
	require.Equal(t, map[string]int{"adopted": n}, states, "no node without its machine")
	require.Equal(t, 0, d.Stop(syscall.SIGTERM), d.Stderr())
}
