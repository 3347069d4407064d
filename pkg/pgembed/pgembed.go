// Package pgembed runs a real PostgreSQL server from the machine's installed
// PostgreSQL binaries and supervises it: for `better-compute dev`, which runs
// the whole control plane in one process, and for tests.
//
// Start initdbs the cluster directory when it is new, starts the postgres
// binary directly (no pg_ctl) and waits until it answers queries; Stop shuts
// it down. When this process runs as root, initdb and postgres run as another
// user (PostgreSQL refuses root). The server gets a parent-death signal, so it
// does an immediate shutdown when this process dies, even by SIGKILL, and
// Start cleans up after a supervisor that was killed: no manual cleanup is
// ever needed.
package pgembed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"golang.org/x/sys/unix"

	"github.com/better-compute/better-compute/pkg/clock"
)

const (
	superuser           = "postgres"
	defaultHost         = "127.0.0.1"
	defaultStartTimeout = 60 * time.Second
	stopGrace           = 10 * time.Second // Stop: SIGINT, then SIGQUIT after this
	quitGrace           = 5 * time.Second  // after SIGQUIT, SIGKILL after this
	orphanGrace         = 10 * time.Second // an orphan gets this long per signal
	pollInterval        = 25 * time.Millisecond
	connectTimeout      = 2 * time.Second
	tailLines           = 50 // server output lines kept for error messages
	errLines            = 8  // of which an error message quotes this many
	memPrefix           = "pgembed-"
	memDataName         = "data"
	minShmFree          = 256 << 20 // bytes free on /dev/shm for a Memory cluster
	shmDir              = "/dev/shm"
)

// ErrNotCluster is wrapped by Start's error when Options.DataDir is a
// non-empty directory that holds no PostgreSQL cluster (it has no PG_VERSION
// file); the error's message names the directory, whose contents are left
// untouched.
var ErrNotCluster = errors.New("data directory holds files that are not a PostgreSQL cluster")

// ErrInUse is wrapped by Start's error when another supervisor (in this or
// another process) holds the lock of the cluster directory; the error's
// message names the directory and the holder's pid.
var ErrInUse = errors.New("data directory is in use by another process")

// dirError is a one-line message that wraps a sentinel error.
type dirError struct {
	msg  string
	kind error
}

func (e *dirError) Error() string { return e.msg }
func (e *dirError) Unwrap() error { return e.kind }

// Options configure Start.
type Options struct {
	// DataDir is the cluster directory. It is initdb'd (and created, mode
	// 0700) when missing or empty and reused when it holds a cluster of the
	// binaries' major version. Required unless Memory is set.
	DataDir string
	// Memory runs a throwaway cluster in a new temporary directory: under
	// /dev/shm when it exists, is writable and has at least 256 MiB free,
	// else under os.TempDir(). The server runs with fsync, synchronous_commit
	// and full_page_writes off, and Stop removes the directory. DataDir must
	// be empty then.
	Memory bool
	// Host is the address the server listens on and URL names; default
	// "127.0.0.1".
	Host string
	// Port is the TCP port; 0 picks a free one.
	Port int
	// Password is the password of the superuser "postgres", who
	// authenticates with scram-sha-256 over TCP. Required; it must not hold a
	// line break. A reused cluster keeps the password it was created with.
	Password string
	// BinDir is the directory of initdb and postgres; default
	// FindBinDir(os.Getenv).
	BinDir string
	// RunAs is, when this process runs as root, the user that initdb and the
	// server run as; default "postgres" when that user exists, else
	// "nobody". When this process is not root, the server runs as this
	// process's user and RunAs must be empty or name that user.
	RunAs string
	// Logger receives the server's output (its stdout and stderr lines) at
	// debug level and the supervisor's rare notices; nil discards.
	Logger *slog.Logger
	// Clock supplies all time: timeouts, grace periods and polling;
	// default clock.New().
	Clock clock.Clock
	// StartTimeout bounds how long Start waits for a started server to
	// answer queries; default 60s.
	StartTimeout time.Duration
}

// Server is a running PostgreSQL server started by Start. Its methods are
// safe for concurrent use.
type Server struct {
	log      *slog.Logger
	clk      clock.Clock
	host     string // as URL spells it
	port     int
	password string
	dataDir  string
	memDir   string // the Memory directory Stop removes, or ""

	pm      *child
	outDone chan struct{} // closed when the server's output pipe reached EOF

	mu   sync.Mutex
	lock *os.File // the locked directory (or, for Memory, lock file); nil once released

	stopOnce sync.Once
	stopErr  error
}

// Start starts a PostgreSQL server as o describes and returns once it
// answers queries. It fails when the binaries are missing, o is invalid, the
// data directory is not usable (ErrNotCluster, ErrInUse, a cluster of another
// major version, not writable or not reachable by the server's user), or the
// server exits or does not answer within o.StartTimeout (the error then quotes
// the server's last output lines). On failure nothing is left running, and a
// directory this call created, or an empty one it initdb'd, is removed or
// emptied again. ctx bounds only the start, not the server's life.
func Start(ctx context.Context, o Options) (srv *Server, err error) {
	if err := o.fill(); err != nil {
		return nil, err
	}
	binDir := o.BinDir
	if binDir == "" {
		if binDir, err = FindBinDir(os.Getenv); err != nil {
			return nil, err
		}
	} else if err := checkBinDir(binDir); err != nil {
		return nil, err
	}
	major, err := serverMajor(binDir)
	if err != nil {
		return nil, err
	}
	ru, err := resolveRunAs(o.RunAs)
	if err != nil {
		return nil, err
	}
	if err := ru.checkBinReach(binDir); err != nil {
		return nil, err
	}

	s := &Server{log: o.Logger, clk: o.Clock, host: connectHost(o.Host), password: o.Password}
	var undo []func() // run in reverse order when Start fails
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	// Memory clusters of supervisors killed before their Stop are removed
	// by whichever Start comes next, of either kind.
	base := memoryBase()
	for _, dir := range uniq(base, os.TempDir()) {
		sweepMemoryDirs(ctx, s.clk, dir, s.log)
	}
	needInit := false
	if o.Memory {
		if s.memDir, err = os.MkdirTemp(base, memPrefix); err != nil && base != os.TempDir() {
			s.memDir, err = os.MkdirTemp(os.TempDir(), memPrefix)
		}
		if err != nil {
			return nil, fmt.Errorf("cannot create a directory for the in-memory cluster: %w", err)
		}
		undo = append(undo, func() { _ = os.RemoveAll(s.memDir) })
		if s.lock, err = lockNew(s.memDir); err != nil {
			return nil, err
		}
		undo = append(undo, s.releaseLock)
		s.dataDir = filepath.Join(s.memDir, memDataName)
		if err := os.Mkdir(s.dataDir, 0o700); err != nil {
			return nil, fmt.Errorf("cannot create the in-memory cluster's directory: %w", err)
		}
		if err := ru.chown(s.memDir); err != nil {
			return nil, err
		}
		if err := ru.chown(s.dataDir); err != nil {
			return nil, err
		}
		needInit = true
	} else {
		if s.dataDir, err = filepath.Abs(o.DataDir); err != nil {
			return nil, fmt.Errorf("data directory %s: %w", o.DataDir, err)
		}
		var created string
		if created, err = createDataDir(s.dataDir); err != nil {
			return nil, err
		}
		// Locked before it is inspected, so that two supervisors never
		// initdb or start the same directory. When the lock is taken, the
		// holder may be initdb'ing a directory this call created: leave it.
		if s.lock, err = lockDir(s.dataDir); err != nil {
			return nil, err
		}
		undo = append(undo, s.releaseLock)
		if created != "" {
			undo = append(undo, func() { _ = os.RemoveAll(created) })
		}
		if err := clearIncompleteInitdb(s.dataDir, s.log); err != nil {
			return nil, err
		}
		if needInit, err = inspectDataDir(s.dataDir, major, ru); err != nil {
			return nil, err
		}
		if needInit && created == "" {
			undo = append(undo, func() { emptyDir(s.dataDir) })
		}
	}

	if needInit {
		if err := initdb(ctx, binDir, s.dataDir, o.Password, ru, s.log, !o.Memory); err != nil {
			return nil, err
		}
	}
	if !o.Memory {
		if err := writeHolderPid(s.dataDir, ru); err != nil {
			return nil, err
		}
		undo = append(undo, s.removeHolderPid)
		if err := clearStale(ctx, s.clk, s.dataDir, s.log); err != nil {
			return nil, err
		}
	}
	caps, err := ru.ambientCaps(reachPath{"data directory", s.dataDir})
	if err != nil {
		return nil, err
	}

	for attempt := 0; ; attempt++ {
		s.port = o.Port
		if s.port == 0 {
			if s.port, err = freePort(o.Host); err != nil {
				return nil, err
			}
		}
		var out *outputTail
		if out, err = s.startPostmaster(binDir, o, ru, caps); err != nil {
			return nil, err
		}
		if err = s.waitReady(ctx, o.StartTimeout, out); err == nil {
			return s, nil
		}
		s.pm.terminate(context.Background(), s.clk, syscall.SIGQUIT, quitGrace)
		s.waitOutput()
		if o.Port != 0 || attempt > 0 || !out.contains("could not bind") {
			return nil, err
		}
		s.log.Debug("the picked port was taken; retrying on another", "port", s.port)
	}
}

// fill validates o and applies the defaults.
func (o *Options) fill() error {
	switch {
	case o.Memory && o.DataDir != "":
		return errors.New("pgembed: Options.DataDir must be empty when Options.Memory is set")
	case !o.Memory && o.DataDir == "":
		return errors.New("pgembed: Options.DataDir is required unless Options.Memory is set")
	case o.Password == "":
		return errors.New("pgembed: Options.Password is required")
	case strings.ContainsAny(o.Password, "\r\n\x00"):
		return errors.New("pgembed: Options.Password must not contain a line break or NUL")
	case o.Port < 0 || o.Port > 65535:
		return fmt.Errorf("pgembed: Options.Port %d is not a TCP port", o.Port)
	case o.StartTimeout < 0:
		return fmt.Errorf("pgembed: Options.StartTimeout %s is negative", o.StartTimeout)
	}
	if o.Host == "" {
		o.Host = defaultHost
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Clock == nil {
		o.Clock = clock.New()
	}
	if o.StartTimeout == 0 {
		o.StartTimeout = defaultStartTimeout
	}
	return nil
}

// memoryBase is where Memory clusters go: /dev/shm when it is a writable
// directory with room for a cluster, else os.TempDir().
func memoryBase() string {
	const wOK, xOK = 0x2, 0x1
	if fi, err := os.Stat(shmDir); err == nil && fi.IsDir() && syscall.Access(shmDir, wOK|xOK) == nil {
		var st syscall.Statfs_t
		if syscall.Statfs(shmDir, &st) == nil && st.Bavail*uint64(st.Bsize) >= minShmFree {
			return shmDir
		}
	}
	return os.TempDir()
}

// createDataDir creates the persistent cluster directory dir (mode 0700;
// missing parents 0755) when it does not exist. It returns the topmost
// directory it created, or "" when dir existed.
func createDataDir(dir string) (string, error) {
	if _, err := os.Lstat(dir); err == nil {
		return "", nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("data directory %s: %w", dir, err)
	}
	created := dir
	for p := filepath.Dir(dir); p != filepath.Dir(p); p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil {
			break
		}
		created = p
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		_ = os.RemoveAll(created)
		return "", fmt.Errorf("cannot create data directory %s: %w", dir, err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		if created != dir {
			_ = os.RemoveAll(created)
		}
		if errors.Is(err, os.ErrExist) {
			return "", nil // created by someone else meanwhile
		}
		return "", fmt.Errorf("cannot create data directory %s: %w", dir, err)
	}
	return created, nil
}

// inspectDataDir checks the persistent cluster directory dir, which exists
// and is locked. It reports whether dir needs an initdb: it is empty; then it
// gets mode 0700 and is given to the server's user.
func inspectDataDir(dir, major string, ru *runUser) (bool, error) {
	fi, err := os.Stat(dir)
	switch {
	case err != nil:
		return false, fmt.Errorf("data directory %s: %w", dir, err)
	case !fi.IsDir():
		return false, fmt.Errorf("data directory %s is not a directory", dir)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return false, fmt.Errorf("data directory %s is not readable: %w", dir, err)
	}
	if len(entries) > 0 {
		return false, checkCluster(dir, major, fi, ru)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return false, fmt.Errorf("data directory %s is not writable: %w", dir, err)
	}
	if err := ru.chown(dir); err != nil {
		return false, err
	}
	return true, nil
}

// checkCluster checks that the non-empty directory dir (stat fi) holds a
// cluster of the binaries' major version owned by the server's user.
func checkCluster(dir, major string, fi os.FileInfo, ru *runUser) error {
	b, err := os.ReadFile(filepath.Join(dir, "PG_VERSION"))
	switch {
	case errors.Is(err, os.ErrNotExist):
		return &dirError{msg: fmt.Sprintf("data directory %s holds files that are not a PostgreSQL cluster (it has no PG_VERSION): use an empty or new directory", dir), kind: ErrNotCluster}
	case err != nil:
		return fmt.Errorf("data directory %s is not readable: %w", dir, err)
	}
	if v := strings.TrimSpace(string(b)); v != major {
		return fmt.Errorf("data directory %s is a PostgreSQL %s cluster; these binaries are PostgreSQL %s (upgrade it with pg_upgrade, or use another directory)", dir, v, major)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != ru.uid {
		if ru.switchTo {
			return fmt.Errorf("data directory %s is owned by uid %d, but the server runs as user %s (uid %d): chown -R %s %s", dir, st.Uid, ru.name, ru.uid, ru.name, dir)
		}
		return fmt.Errorf("data directory %s is owned by uid %d, but this process (and so the server) runs as uid %d", dir, st.Uid, ru.uid)
	}
	return nil
}

// emptyDir removes everything inside dir.
func emptyDir(dir string) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		_ = os.RemoveAll(filepath.Join(dir, e.Name()))
	}
}

// initdbMarker is the file beside the cluster directory dir that exists
// while an initdb of dir runs: an initdb that a killed supervisor left
// half-done leaves it behind, and the next Start empties dir and runs
// initdb again (clearIncompleteInitdb). It holds the superuser's password
// for initdb's --pwfile meanwhile, so no copy of the password outlives it.
func initdbMarker(dir string) string {
	return filepath.Join(filepath.Dir(dir), "."+filepath.Base(dir)+".initdb")
}

// clearIncompleteInitdb empties the locked cluster directory dir when the
// initdb that made it did not finish (its marker is there).
func clearIncompleteInitdb(dir string, log *slog.Logger) error {
	marker := initdbMarker(dir)
	if _, err := os.Lstat(marker); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	log.Warn("the last initdb of this data directory did not finish (its supervisor was killed); making the cluster again", "dir", dir)
	emptyDir(dir)
	if err := os.Remove(marker); err != nil {
		return fmt.Errorf("data directory %s: cannot remove %s: %w", dir, marker, err)
	}
	return nil
}

// afterInitdbStarted runs once initdb has started, with its pid (a test
// hook).
var afterInitdbStarted = func(int) {}

// initdb creates a cluster in the empty directory dir. With durable, the
// cluster's files are on disk before its marker goes.
func initdb(ctx context.Context, binDir, dir, password string, ru *runUser, log *slog.Logger, durable bool) (err error) {
	marker := initdbMarker(dir)
	pw, err := os.OpenFile(marker, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("cannot write initdb's password file beside the data directory: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.Remove(marker) // the caller empties dir again
		}
	}()
	_, err = pw.WriteString(password + "\n")
	if cerr := pw.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("cannot write initdb's password file %s: %w", pw.Name(), err)
	}
	if err := ru.chown(pw.Name()); err != nil {
		return err
	}
	caps, err := ru.ambientCaps(reachPath{"data directory", dir}, reachPath{"initdb's password file", pw.Name()})
	if err != nil {
		return err
	}

	out := &outputTail{log: log, name: "initdb"}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("initdb: %w", err)
	}
	outDone := make(chan struct{})
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"),
		"-D", dir, "-U", superuser, "--auth=scram-sha-256", "--pwfile="+pw.Name(),
		"-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
	cmd.Dir = "/"
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid:     true,
		Pdeathsig:   syscall.SIGKILL,
		Credential:  ru.credential(),
		AmbientCaps: caps,
	}
	c, err := launch(cmd)
	_ = w.Close()
	if err != nil {
		_ = r.Close()
		return fmt.Errorf("cannot run %s: %w", cmd.Path, err)
	}
	afterInitdbStarted(cmd.Process.Pid)
	go out.consume(r, outDone)
	<-c.done
	<-outDone // initdb waits for its own children, so the pipe is closed
	if c.err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("initdb of data directory %s: %w", dir, ctx.Err())
		}
		return fmt.Errorf("initdb of data directory %s failed (%s): %s", dir, exitString(c.err), out.last(errLines))
	}
	if durable {
		// initdb ran with --no-sync: one syncfs instead of its fsync per file.
		if err := syncFS(dir); err != nil {
			return fmt.Errorf("initdb of data directory %s: sync: %w", dir, err)
		}
	}
	if err := os.Remove(marker); err != nil {
		return fmt.Errorf("initdb of data directory %s: %w", dir, err)
	}
	return nil
}

// syncFS flushes the file system holding dir to disk.
func syncFS(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.Syncfs(int(f.Fd()))
}

// uniq returns dirs without repeats, in order.
func uniq(dirs ...string) []string {
	var out []string
	for _, d := range dirs {
		if !slices.Contains(out, d) {
			out = append(out, d)
		}
	}
	return out
}

// freePort returns a TCP port that was free on host a moment ago.
func freePort(host string) (int, error) {
	if host == "*" {
		host = ""
	}
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("cannot find a free port on %s: %w", host, err)
	}
	defer l.Close()
	addr, ok := l.Addr().(*net.TCPAddr)
	if !ok {
		return 0, fmt.Errorf("cannot find a free port on %s: unexpected address %s", host, l.Addr())
	}
	return addr.Port, nil
}

// connectHost is the address clients dial for a server listening on host.
func connectHost(host string) string {
	switch host {
	case "*", "0.0.0.0":
		return "127.0.0.1"
	case "::", "[::]":
		return "::1"
	}
	return strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
}

// startPostmaster starts postgres on s.port.
func (s *Server) startPostmaster(binDir string, o Options, ru *runUser, caps []uintptr) (*outputTail, error) {
	args := []string{
		"-D", s.dataDir,
		"-p", strconv.Itoa(s.port),
		"-c", "listen_addresses=" + o.Host,
		"-c", "unix_socket_directories=",
		"-c", "logging_collector=off",
		"-c", "max_connections=200",
	}
	if o.Memory {
		args = append(args, "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	cmd := exec.Command(filepath.Join(binDir, "postgres"), args...)
	cmd.Dir = "/"
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// Its own process group: a terminal's Ctrl-C reaches only this
		// process, which then stops the server (a SIGINT to postgres itself
		// would race that with a fast shutdown of its own).
		Setpgid: true,
		// Immediate shutdown when the thread that started it (and so this
		// process) dies, even by SIGKILL.
		Pdeathsig:   syscall.SIGQUIT,
		Credential:  ru.credential(),
		AmbientCaps: caps,
	}
	pm, err := launch(cmd)
	_ = w.Close()
	if err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("cannot run %s: %w", cmd.Path, err)
	}
	out := &outputTail{log: s.log, name: "postgres"}
	s.pm, s.outDone = pm, make(chan struct{})
	go out.consume(r, s.outDone)
	return out, nil
}

// waitReady polls the server until it answers SELECT 1, exits, refuses the
// password, or timeout passes.
func (s *Server) waitReady(ctx context.Context, timeout time.Duration, out *outputTail) error {
	deadline := s.clk.NewTimer(timeout)
	defer deadline.Stop()
	// A ping ends when the server exits: what answers on the port is then
	// not this server, and may never answer.
	pingCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.pm.done:
			cancel()
		case <-pingCtx.Done():
		}
	}()
	var last error
	for {
		if s.pm.exited() {
			return s.startupExit(out)
		}
		last = ping(pingCtx, s.URL("postgres"))
		if last == nil {
			return nil
		}
		var pgErr *pgconn.PgError
		if errors.As(last, &pgErr) && strings.HasPrefix(pgErr.Code, "28") { // invalid authorization
			return fmt.Errorf("postgres of data directory %s refused Options.Password (%s): a reused cluster keeps the password it was created with", s.dataDir, pgErr.Message)
		}
		tick := s.clk.NewTimer(pollInterval)
		select {
		case <-s.pm.done:
		case <-tick.C():
		case <-ctx.Done():
			tick.Stop()
			return fmt.Errorf("waiting for postgres of data directory %s to accept connections: %w", s.dataDir, ctx.Err())
		case <-deadline.C():
			tick.Stop()
			return fmt.Errorf("postgres of data directory %s did not accept connections on port %d within %s (%w); its last output: %s",
				s.dataDir, s.port, timeout, last, out.last(errLines))
		}
		tick.Stop()
	}
}

// startupExit is the error for a server that exited while starting.
func (s *Server) startupExit(out *outputTail) error {
	s.waitOutput()
	return fmt.Errorf("postgres of data directory %s exited while starting (%s): %s", s.dataDir, exitString(s.pm.err), out.last(errLines))
}

// exitString describes how a process ended, given cmd.Wait's result.
func exitString(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// waitOutput waits, briefly, until the server's output pipe is closed (its
// children hold it too; they exit soon after the postmaster).
func (s *Server) waitOutput() {
	t := s.clk.NewTimer(quitGrace)
	defer t.Stop()
	select {
	case <-s.outDone:
	case <-t.C():
	}
}

// ping connects to url and runs SELECT 1.
func ping(ctx context.Context, url string) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.ConnectTimeout = connectTimeout
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var one int
	return conn.QueryRow(ctx, "SELECT 1").Scan(&one)
}

// URL returns the connection URL of database as the superuser:
// postgres://postgres:<URL-encoded password>@host:port/<database>?sslmode=disable.
func (s *Server) URL(database string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.UserPassword(superuser, s.password),
		Host:     net.JoinHostPort(s.host, strconv.Itoa(s.port)),
		Path:     "/" + database,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Port returns the TCP port the server listens on.
func (s *Server) Port() int { return s.port }

// PID returns the process id of the postmaster (the server's main process).
func (s *Server) PID() int { return s.pm.cmd.Process.Pid }

// DataDir returns the absolute path of the cluster directory; for a Memory
// server it lies inside the temporary directory that Stop removes.
func (s *Server) DataDir() string { return s.dataDir }

// Done returns a channel that is closed when the postmaster has exited, for
// whatever reason: Stop, a crash, or a signal from elsewhere.
func (s *Server) Done() <-chan struct{} { return s.pm.done }

// Stop shuts the server down and waits until it has exited: a fast shutdown
// (SIGINT to the postmaster), then, when ctx ends or 10s pass first, an
// immediate shutdown (SIGQUIT) and, 5s later, SIGKILL. It then releases the
// cluster's lock and, for a Memory server, removes its directory. It returns
// an error only when that directory cannot be removed. Stop is idempotent:
// later calls wait for the first and return its result.
func (s *Server) Stop(ctx context.Context) error {
	s.stopOnce.Do(func() { s.stopErr = s.stop(ctx) })
	return s.stopErr
}

func (s *Server) stop(ctx context.Context) error {
	if forced := s.pm.terminate(ctx, s.clk, syscall.SIGINT, stopGrace); forced {
		s.log.Warn("postgres did not shut down in time and was stopped with SIGQUIT/SIGKILL", "pid", s.PID(), "data_dir", s.dataDir)
	}
	s.waitOutput()
	s.removeHolderPid()
	s.releaseLock()
	if s.memDir != "" {
		if err := os.RemoveAll(s.memDir); err != nil {
			return fmt.Errorf("cannot remove the in-memory cluster %s: %w", s.memDir, err)
		}
	}
	return nil
}

// removeHolderPid removes the pid file of a persistent cluster's lock holder.
func (s *Server) removeHolderPid() {
	if s.memDir == "" {
		_ = os.Remove(filepath.Join(s.dataDir, holderName))
	}
}

// releaseLock closes the lock file (the locked directory of a persistent
// cluster), releasing the lock; postgres keeps running. Tests use it to act
// as a supervisor that was killed.
func (s *Server) releaseLock() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lock != nil {
		_ = s.lock.Close()
		s.lock = nil
	}
}
