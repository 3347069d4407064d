package pgembed

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/syncbuf"
)

// testPassword needs URL encoding, so URL is exercised too.
const testPassword = "s3cret /:@?#%&+pw"

// start starts a server and stops it when the test ends.
func start(t *testing.T, o Options) *Server {
	t.Helper()
	if o.Password == "" {
		o.Password = testPassword
	}
	s, err := Start(t.Context(), o)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Stop(context.Background())) })
	return s
}

// query runs sql on the server's postgres database and returns the first
// column of the first row as text.
func query(t *testing.T, s *Server, sql string, args ...any) string {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), s.URL("postgres"))
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var v string
	require.NoError(t, conn.QueryRow(t.Context(), sql, args...).Scan(&v))
	return v
}

func exec1(t *testing.T, s *Server, sql string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), s.URL("postgres"))
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(t.Context(), sql)
	require.NoError(t, err)
}

// eventually polls cond on the real clock until it holds or d passes.
func eventually(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	clk := clock.New()
	deadline := clk.Now().Add(d)
	for !cond() {
		if !clk.Now().Before(deadline) {
			t.Fatalf("after %s: %s", d, what)
		}
		require.NoError(t, clock.Sleep(t.Context(), clk, 20*time.Millisecond))
	}
}

// procStatus returns a field of /proc/<pid>/status.
func procStatus(t *testing.T, pid int, field string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return ""
}

func procCaps(t *testing.T, pid int, field string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(procStatus(t, pid, field), 16, 64)
	require.NoError(t, err)
	return n
}

// requireServerUser checks the uid postgres runs as: RunAs's default when the
// test runs as root, else the test's own.
func requireServerUser(t *testing.T, pid int) {
	t.Helper()
	uid, err := strconv.Atoi(strings.Fields(procStatus(t, pid, "Uid"))[1]) // real, effective, saved, fs
	require.NoError(t, err)
	if os.Geteuid() != 0 {
		require.Equal(t, os.Geteuid(), uid)
		return
	}
	want, err := user.Lookup("postgres")
	if err != nil {
		want, err = user.Lookup("nobody")
	}
	require.NoError(t, err)
	require.NotZero(t, uid, "postgres must not run as root")
	require.Equal(t, want.Uid, strconv.Itoa(uid))
}

// requireCaps checks the postmaster's effective and ambient capabilities:
// none, or (lent) exactly one of DAC_READ_SEARCH and DAC_OVERRIDE.
func requireCaps(t *testing.T, pid int, lent bool) {
	t.Helper()
	eff, amb := procCaps(t, pid, "CapEff"), procCaps(t, pid, "CapAmb")
	if !lent || os.Geteuid() != 0 {
		require.Zero(t, eff, "CapEff")
		require.Zero(t, amb, "CapAmb")
		return
	}
	require.Contains(t, []uint64{1 << capDACReadSearch, 1 << capDACOverride}, eff, "CapEff")
	require.Equal(t, eff, amb, "CapAmb")
}

func TestMemoryServer(t *testing.T) {
	t.Parallel()
	var logs syncbuf.Buffer
	s := start(t, Options{
		Memory: true,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	require.Equal(t, "1", query(t, s, "SELECT 1::text"))
	require.Equal(t, "off", query(t, s, "SHOW fsync"))
	require.Equal(t, "off", query(t, s, "SHOW synchronous_commit"))
	require.Equal(t, "off", query(t, s, "SHOW full_page_writes"))
	require.Equal(t, "UTF8", query(t, s, "SHOW server_encoding"))
	require.Contains(t, s.URL("app"), "/app?sslmode=disable")
	require.Contains(t, s.URL("app"), ":"+strconv.Itoa(s.Port())+"/")
	require.Contains(t, logs.String(), "database system is ready to accept connections")

	dir := filepath.Dir(s.DataDir())
	require.True(t, strings.HasPrefix(filepath.Base(dir), memPrefix), dir)
	if shmUsable(t) {
		require.Equal(t, shmDir, filepath.Dir(dir))
	}
	requireServerUser(t, s.PID())
	requireCaps(t, s.PID(), false)

	pid := s.PID()
	require.NoError(t, s.Stop(t.Context()))
	require.NoError(t, s.Stop(t.Context()), "Stop is idempotent")
	require.NoDirExists(t, dir)
	require.False(t, alive(pid), "postmaster %d still alive", pid)
	select {
	case <-s.Done():
	default:
		t.Fatal("Done is open after Stop")
	}
}

// shmUsable reports whether /dev/shm should hold Memory clusters: a
// writable directory with room for one.
func shmUsable(t *testing.T) bool {
	var st syscall.Statfs_t
	if err := syscall.Statfs(shmDir, &st); err != nil {
		return false
	}
	f, err := os.CreateTemp(shmDir, "pgembed-test-")
	if err != nil {
		return false
	}
	_ = f.Close()
	require.NoError(t, os.Remove(f.Name()))
	return st.Bavail*uint64(st.Bsize) >= minShmFree
}

func TestPersistentClusterIsReused(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "nested", "data")
	s := start(t, Options{DataDir: dir})
	requireServerUser(t, s.PID())
	// t.TempDir()'s parent is mode 0700, so a server that is not root
	// reaches the directory only through the lent capability.
	requireCaps(t, s.PID(), true)
	// A table of the test's own, not the store's: the cluster keeps it.
	exec1(t, s, "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('row one')")
	require.Equal(t, dir, s.DataDir())
	require.NoError(t, s.Stop(t.Context()))
	require.False(t, alive(s.PID()))

	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
	require.FileExists(t, filepath.Join(dir, "PG_VERSION"))

	s2 := start(t, Options{DataDir: dir})
	require.Equal(t, "row one", query(t, s2, "SELECT v FROM kept"))
	requireServerUser(t, s2.PID())
}

// deadPid returns the pid of a process that has exited.
func deadPid(t *testing.T) int {
	t.Helper()
	bin, err := FindBinDir(os.Getenv)
	require.NoError(t, err)
	cmd := exec.Command(filepath.Join(bin, "postgres"), "--version")
	require.NoError(t, cmd.Run())
	require.False(t, alive(cmd.Process.Pid))
	return cmd.Process.Pid
}

func writePostmasterPid(t *testing.T, dir string, pid int) {
	t.Helper()
	content := strconv.Itoa(pid) + "\n" + dir + "\n1700000000\n5432\n\n127.0.0.1\n  5432001        42\nready   \n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "postmaster.pid"), []byte(content), 0o600))
}

func TestStalePostmasterPid(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "data")
	s := start(t, Options{DataDir: dir})
	require.NoError(t, s.Stop(t.Context()))

	// A killed server's pid, now dead.
	writePostmasterPid(t, dir, deadPid(t))
	s = start(t, Options{DataDir: dir})
	require.Equal(t, "1", query(t, s, "SELECT 1::text"))
	require.NoError(t, s.Stop(t.Context()))

	// A pid since reused by another program, which must be left alone.
	other := exec.Command("cat")
	stdin, err := other.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, other.Start())
	t.Cleanup(func() { _ = stdin.Close(); _ = other.Wait() })
	writePostmasterPid(t, dir, other.Process.Pid)
	s = start(t, Options{DataDir: dir})
	require.Equal(t, "1", query(t, s, "SELECT 1::text"))
	require.True(t, alive(other.Process.Pid), "an unrelated process was signalled")
}

func TestOrphanedPostmasterIsReplaced(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "data")
	old := start(t, Options{DataDir: dir})
	oldPid := old.PID()
	// A killed supervisor: its lock is gone, its postgres runs on.
	old.releaseLock()
	require.True(t, alive(oldPid))

	s := start(t, Options{DataDir: dir})
	require.False(t, alive(oldPid), "the orphaned postmaster %d still runs", oldPid)
	select {
	case <-old.Done():
	default:
		t.Fatal("the orphaned postmaster has not exited")
	}
	require.NotEqual(t, oldPid, s.PID())
	require.Equal(t, "1", query(t, s, "SELECT 1::text"))
}

func TestLockedDataDirIsInUse(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "data")
	s := start(t, Options{DataDir: dir})

	_, err := Start(t.Context(), Options{DataDir: dir, Password: testPassword})
	require.ErrorIs(t, err, ErrInUse)
	require.Contains(t, err.Error(), dir)
	require.Contains(t, err.Error(), "pid "+strconv.Itoa(os.Getpid()))
	require.Equal(t, "1", query(t, s, "SELECT 1::text"), "the running server is unharmed")
}

func TestConcurrentStartsOnANewDir(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "data")
	type result struct {
		s   *Server
		err error
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			s, err := Start(t.Context(), Options{DataDir: dir, Password: testPassword})
			results <- result{s, err}
		}()
	}
	var won *Server
	var lost error
	for range 2 {
		r := <-results
		if r.err == nil {
			require.Nil(t, won, "both Starts succeeded")
			won = r.s
			t.Cleanup(func() { require.NoError(t, r.s.Stop(context.Background())) })
		} else {
			lost = r.err
		}
	}
	require.NotNil(t, won, "no Start succeeded: %v", lost)
	require.ErrorIs(t, lost, ErrInUse)
	require.Equal(t, "1", query(t, won, "SELECT 1::text"))
}

func TestDataDirErrors(t *testing.T) {
	t.Parallel()
	t.Run("not a cluster", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("mine"), 0o644))
		_, err := Start(t.Context(), Options{DataDir: dir, Password: testPassword})
		require.ErrorIs(t, err, ErrNotCluster)
		require.Contains(t, err.Error(), dir)
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Len(t, entries, 1)
		b, err := os.ReadFile(filepath.Join(dir, "notes.txt"))
		require.NoError(t, err)
		require.Equal(t, "mine", string(b))
	})
	t.Run("other major version", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(dir, "PG_VERSION"), []byte("9.6\n"), 0o600))
		_, err := Start(t.Context(), Options{DataDir: dir, Password: testPassword})
		require.ErrorContains(t, err, "data directory "+dir+" is a PostgreSQL 9.6 cluster; these binaries are PostgreSQL ")
		require.NotErrorIs(t, err, ErrNotCluster)
	})
	t.Run("bad options", func(t *testing.T) {
		_, err := Start(t.Context(), Options{Memory: true, DataDir: t.TempDir(), Password: testPassword})
		require.ErrorContains(t, err, "DataDir must be empty when Options.Memory is set")
		_, err = Start(t.Context(), Options{Memory: true})
		require.ErrorContains(t, err, "Password is required")
		_, err = Start(t.Context(), Options{Password: testPassword})
		require.ErrorContains(t, err, "DataDir is required")
	})
}

func TestBinaries(t *testing.T) {
	t.Parallel()
	env := func(vars map[string]string) func(string) string {
		return func(k string) string { return vars[k] }
	}
	_, err := FindBinDir(env(map[string]string{envBinDir: "/nonexistent/pg/bin"}))
	require.ErrorContains(t, err, "BETTER_COMPUTE_POSTGRES_BIN=/nonexistent/pg/bin")
	require.ErrorContains(t, err, "apt-get install postgresql")

	found, err := FindBinDir(os.Getenv)
	require.NoError(t, err)
	require.Empty(t, missingBinaries(found))
	got, err := FindBinDir(env(map[string]string{envBinDir: found}))
	require.NoError(t, err)
	require.Equal(t, found, got)

	empty := t.TempDir()
	_, err = Start(t.Context(), Options{Memory: true, Password: testPassword, BinDir: empty})
	require.ErrorContains(t, err, "apt-get install postgresql")
	require.ErrorContains(t, err, empty)
}

func TestCapabilityLending(t *testing.T) {
	t.Parallel()
	// A stranger to t.TempDir()'s parent, which is mode 0700.
	ru := &runUser{name: "stranger", uid: 4242424, gid: 4242424, switchTo: true}
	dir := filepath.Join(t.TempDir(), "data")
	require.NoError(t, os.Mkdir(dir, 0o700))
	blocking := filepath.Dir(filepath.Dir(dir))
	data := reachPath{"data directory", dir}

	_, err := ru.ambientCapsWith(0, data)
	require.ErrorContains(t, err, "data directory "+dir+" cannot be reached by user stranger: "+blocking+" is not searchable")
	require.ErrorContains(t, err, "CAP_DAC_READ_SEARCH")

	for _, tc := range []struct {
		permitted uint64
		want      []uintptr
	}{
		{1<<capDACReadSearch | 1<<capDACOverride, []uintptr{capDACReadSearch}},
		{1 << capDACReadSearch, []uintptr{capDACReadSearch}},
		{1 << capDACOverride, []uintptr{capDACOverride}},
	} {
		caps, err := ru.ambientCapsWith(tc.permitted, data)
		require.NoError(t, err)
		require.Equal(t, tc.want, caps, "permitted %#x", tc.permitted)
	}

	// Nothing to lend when every ancestor is searchable, or when this
	// process does not switch users.
	caps, err := ru.ambientCapsWith(0, reachPath{"data directory", "/usr/lib/x"})
	require.NoError(t, err)
	require.Empty(t, caps)
	caps, err = (&runUser{uid: 4242424}).ambientCapsWith(0, data)
	require.NoError(t, err)
	require.Empty(t, caps)
}

// memDirs lists the Memory directories in the base directory, leaving out
// those that other processes (say, a developer's `better-compute dev`) hold.
func memDirs(t *testing.T) map[string]bool {
	t.Helper()
	entries, err := os.ReadDir(memoryBase())
	require.NoError(t, err)
	dirs := map[string]bool{}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), memPrefix) {
			continue
		}
		b, err := os.ReadFile(filepath.Join(memoryBase(), e.Name(), lockName))
		if err == nil && strings.TrimSpace(string(b)) != strconv.Itoa(os.Getpid()) {
			continue
		}
		dirs[e.Name()] = true
	}
	return dirs
}

// Not parallel: it compares listings of the directory that the other tests'
// Memory servers use.
func TestFailedMemoryStartLeavesNothing(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port

	before := memDirs(t)
	_, err = Start(t.Context(), Options{Memory: true, Password: testPassword, Port: port})
	require.ErrorContains(t, err, "could not bind")
	require.ErrorContains(t, err, "exited while starting (exit status 1): ")
	require.NotRegexp(t, `UTC \[\d+\]`, err.Error(), "log line prefixes are left out")
	require.NotContains(t, err.Error(), "\n", "errors are one line")
	for name := range memDirs(t) {
		require.True(t, before[name], "Start left %s behind", name)
	}
}

// TestParentDeathSignal kills a supervisor with SIGKILL: its postgres must
// shut down by itself. The supervisor is this test binary, re-executed. Not
// parallel: every Memory start sweeps the directories of killed
// supervisors, so another test's start could sweep the killed one's before
// this test sees it left behind (CI saw it gone).
func TestParentDeathSignal(t *testing.T) {
	if os.Getenv("PGEMBED_CHILD") == "1" {
		parentDeathChild(t)
		return
	}
	t.Run("memory", func(t *testing.T) {
		dir := killedSupervisor(t, "")
		require.DirExists(t, dir)
		// The next Memory start sweeps the killed supervisor's directory.
		start(t, Options{Memory: true})
		require.NoDirExists(t, filepath.Dir(dir))
	})
	t.Run("data dir", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "data")
		killedSupervisor(t, dir)
		s := start(t, Options{DataDir: dir})
		require.Equal(t, "1", query(t, s, "SELECT 1::text"))
	})
	t.Run("during initdb", func(t *testing.T) {
		// A supervisor killed while initdb runs (initdb's pid is what the
		// child reports here) leaves a half-made cluster and initdb's marker,
		// which holds the password: the next Start makes the cluster again
		// and removes the marker.
		dir := filepath.Join(t.TempDir(), "data")
		killedSupervisor(t, dir, "PGEMBED_HANG_IN_INITDB=1")
		require.FileExists(t, initdbMarker(dir))
		s := start(t, Options{DataDir: dir})
		require.Equal(t, "1", query(t, s, "SELECT 1::text"))
		require.NoFileExists(t, initdbMarker(dir))
	})
}

// TestIncompleteInitdbIsRedone: a cluster directory beside its initdb marker
// is one whose initdb never finished, whatever it holds: Start empties it and
// runs initdb again. Without the marker the cluster is kept.
func TestIncompleteInitdbIsRedone(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "data")
	s := start(t, Options{DataDir: dir})
	require.NoFileExists(t, initdbMarker(dir), "a finished initdb leaves no marker")
	exec1(t, s, "CREATE TABLE sentinel (x int)")
	require.NoError(t, s.Stop(t.Context()))
	s = start(t, Options{DataDir: dir})
	require.Equal(t, "1", query(t, s, "SELECT count(*)::text FROM pg_tables WHERE tablename = 'sentinel'"))
	require.NoError(t, s.Stop(t.Context()))

	require.NoError(t, os.WriteFile(initdbMarker(dir), []byte("x\n"), 0o600))
	s = start(t, Options{DataDir: dir})
	require.Equal(t, "0", query(t, s, "SELECT count(*)::text FROM pg_tables WHERE tablename = 'sentinel'"))
	require.NoFileExists(t, initdbMarker(dir))
}

// killedSupervisor runs a child supervisor of a server on dataDir (Memory when
// empty), SIGKILLs it and waits until its postmaster is gone. It returns the
// postmaster's data directory.
func killedSupervisor(t *testing.T, dataDir string, env ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestParentDeathSignal$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(append(os.Environ(), "PGEMBED_CHILD=1", "PGEMBED_DATA_DIR="+dataDir), env...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr syncbuf.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})

	type report struct {
		pid int
		dir string
	}
	reports := make(chan report, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var r report
			for f := range strings.FieldsSeq(sc.Text()) {
				if v, ok := strings.CutPrefix(f, "PGEMBED_PID="); ok {
					r.pid, _ = strconv.Atoi(v)
				} else if v, ok := strings.CutPrefix(f, "PGEMBED_DIR="); ok {
					r.dir = v
				}
			}
			if r.pid > 0 {
				reports <- r
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		close(reports)
	}()
	clk := clock.New()
	timeout := clk.NewTimer(2 * time.Minute)
	defer timeout.Stop()
	var r report
	select {
	case got, ok := <-reports:
		require.True(t, ok, "the child exited without starting a server: %s", stderr.String())
		r = got
	case <-timeout.C():
		t.Fatalf("the child did not start a server: %s", stderr.String())
	}
	require.True(t, alive(r.pid))
	requireServerUser(t, r.pid)

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	err = cmd.Wait()
	var exitErr *exec.ExitError
	require.ErrorAs(t, err, &exitErr)
	eventually(t, 15*time.Second, func() bool { return !alive(r.pid) },
		"postmaster "+strconv.Itoa(r.pid)+" outlived its killed supervisor")
	return r.dir
}

// parentDeathChild is the child side of TestParentDeathSignal: it starts a
// server, reports it on stdout and runs until its stdin closes. With
// PGEMBED_HANG_IN_INITDB=1 it reports initdb's start instead and hangs there.
func parentDeathChild(t *testing.T) {
	if os.Getenv("PGEMBED_HANG_IN_INITDB") == "1" {
		afterInitdbStarted = func(pid int) {
			_, _ = os.Stdout.WriteString("PGEMBED_PID=" + strconv.Itoa(pid) + " PGEMBED_DIR=initdb\n")
			select {} // until killed
		}
	}
	o := Options{Password: testPassword, DataDir: os.Getenv("PGEMBED_DATA_DIR")}
	o.Memory = o.DataDir == ""
	s, err := Start(context.Background(), o)
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	_, err = os.Stdout.WriteString("PGEMBED_PID=" + strconv.Itoa(s.PID()) + " PGEMBED_DIR=" + s.DataDir() + "\n")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, os.Stdin)
	require.NoError(t, s.Stop(context.Background()))
}
