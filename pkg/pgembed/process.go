package pgembed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
)

// child is a process started by launch.
type child struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process exited and was reaped
	err  error         // cmd.Wait's result; read only after done is closed
}

// launch starts cmd from a goroutine locked to its OS thread and keeps that
// goroutine (and so the thread) waiting for the process. A parent-death signal
// (SysProcAttr.Pdeathsig) fires when the thread that forked the child exits,
// not the process: started from an ordinary goroutine, the child could be
// signalled whenever the Go runtime retires that thread.
func launch(cmd *exec.Cmd) (*child, error) {
	c := &child{cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		// Never unlocked: the thread ends with this goroutine, after the
		// child has exited.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		c.err = cmd.Wait()
		close(c.done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return c, nil
}

// exited reports whether the process has exited.
func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// signal sends sig unless the process has already exited.
func (c *child) signal(sig os.Signal) {
	if !c.exited() {
		_ = c.cmd.Process.Signal(sig)
	}
}

// waitFor waits until the process exits, ctx ends or d passes on clk; it
// reports whether the process exited.
func (c *child) waitFor(ctx context.Context, clk clock.Clock, d time.Duration) bool {
	t := clk.NewTimer(d)
	defer t.Stop()
	select {
	case <-c.done:
		return true
	case <-ctx.Done():
	case <-t.C():
	}
	return c.exited()
}

// terminate ends the process: sig first, then, after grace, SIGQUIT (when sig
// was gentler) and SIGKILL. It returns once the process has exited.
func (c *child) terminate(ctx context.Context, clk clock.Clock, sig syscall.Signal, grace time.Duration) (forced bool) {
	c.signal(sig)
	if c.waitFor(ctx, clk, grace) {
		return false
	}
	if sig != syscall.SIGQUIT && sig != syscall.SIGKILL {
		c.signal(syscall.SIGQUIT)
		if c.waitFor(context.Background(), clk, quitGrace) {
			return true
		}
	}
	c.signal(syscall.SIGKILL)
	<-c.done
	return true
}

// outputTail keeps the last lines a process wrote and logs each at debug.
type outputTail struct {
	log  *slog.Logger
	name string

	mu    sync.Mutex
	lines []string
}

const maxLineBytes = 4 << 10

// consume reads r to its end, then closes r and done.
func (t *outputTail) consume(r io.ReadCloser, done chan<- struct{}) {
	defer close(done)
	defer r.Close()
	br := bufio.NewReaderSize(r, 16<<10)
	for {
		line, err := br.ReadString('\n')
		if line = strings.TrimRight(line, "\r\n"); line != "" {
			if len(line) > maxLineBytes {
				line = line[:maxLineBytes] + "…"
			}
			t.add(line)
		}
		if err != nil {
			return
		}
	}
}

func (t *outputTail) add(line string) {
	t.log.Debug(t.name+" output", "line", line)
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.lines) == tailLines {
		copy(t.lines, t.lines[1:])
		t.lines = t.lines[:tailLines-1]
	}
	t.lines = append(t.lines, line)
}

// last returns the last n lines joined into one line.
func (t *outputTail) last(n int) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	lines := t.lines
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	if len(lines) == 0 {
		return "(no output)"
	}
	short := make([]string, len(lines))
	for i, l := range lines {
		short[i] = logPrefix.ReplaceAllString(l, "")
	}
	return strings.Join(short, " | ")
}

// logPrefix matches PostgreSQL's default log_line_prefix ('%m [%p] '), which
// error messages leave out.
var logPrefix = regexp.MustCompile(`^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \S+ \[\d+\] `)

func (t *outputTail) contains(s string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, l := range t.lines {
		if strings.Contains(l, s) {
			return true
		}
	}
	return false
}

// childEnv is this process's environment without the PG* variables, which
// would otherwise change what initdb and postgres do.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			env = append(env, kv)
		}
	}
	return env
}

// alive reports whether pid names a live process (a zombie is not).
func alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	if state, ok := procState(pid); ok {
		return state != 'Z' && state != 'X'
	}
	return true // kill(0) succeeded or was refused (EPERM): it exists
}

// procState returns the state letter of /proc/<pid>/stat.
func procState(pid int) (byte, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) {
		return 0, false
	}
	return b[i+2], true
}

// isPostgresOf reports whether pid is a postgres process whose data
// directory is dir (a path without symlinks): its working directory is dir
// (every postgres process changes to its data directory) or its command line
// names dir.
func isPostgresOf(pid int, dir string) bool {
	proc := "/proc/" + strconv.Itoa(pid)
	comm, err := os.ReadFile(proc + "/comm")
	if err != nil {
		return false
	}
	if name := strings.TrimSpace(string(comm)); name != "postgres" && name != "postmaster" {
		return false
	}
	if cwd, err := os.Readlink(proc + "/cwd"); err == nil && cwd == dir {
		return true
	}
	cmdline, err := os.ReadFile(proc + "/cmdline")
	if err != nil {
		return false
	}
	for arg := range strings.SplitSeq(string(cmdline), "\x00") {
		if arg != "" && filepath.Clean(arg) == dir {
			return true
		}
	}
	return false
}

// postgresProcsIn lists the postgres processes (other than this one) whose
// working directory is dir.
func postgresProcsIn(dir string) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		proc := "/proc/" + e.Name()
		if comm, err := os.ReadFile(proc + "/comm"); err != nil || strings.TrimSpace(string(comm)) != "postgres" {
			continue
		}
		if cwd, err := os.Readlink(proc + "/cwd"); err == nil && cwd == dir && alive(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// stopPids sends sig to pids and waits until none is alive, up to grace on
// clk; it reports the pids still alive.
func stopPids(ctx context.Context, clk clock.Clock, pids []int, sig syscall.Signal, grace time.Duration) []int {
	for _, pid := range pids {
		_ = syscall.Kill(pid, sig)
	}
	deadline := clk.Now().Add(grace)
	for {
		var left []int
		for _, pid := range pids {
			if alive(pid) {
				left = append(left, pid)
			}
		}
		if len(left) == 0 || !clk.Now().Before(deadline) {
			return left
		}
		if clock.Sleep(ctx, clk, pollInterval) != nil {
			return left
		}
		pids = left
	}
}

// clearStale removes what a killed supervisor of dir left behind. The
// caller holds dir's lock, so no live supervisor owns a postgres there. A
// postmaster named by postmaster.pid that is a postgres of dir is an orphan:
// it gets SIGQUIT (an immediate shutdown) and, after orphanGrace, SIGKILL.
// Remaining postgres processes of dir (backends of a postmaster that was
// SIGKILLed) are killed, and postmaster.pid is removed.
func clearStale(ctx context.Context, clk clock.Clock, dir string, log *slog.Logger) error {
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return fmt.Errorf("data directory %s: %w", dir, err)
	}
	pidFile := filepath.Join(dir, "postmaster.pid")
	b, err := os.ReadFile(pidFile)
	switch {
	case errors.Is(err, os.ErrNotExist):
		b = nil
	case err != nil:
		return fmt.Errorf("data directory %s: cannot read postmaster.pid: %w", dir, err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	if pid, err := strconv.Atoi(strings.TrimSpace(first)); err == nil && pid != os.Getpid() && alive(pid) && isPostgresOf(pid, real) {
		log.Info("stopping an orphaned postgres of a killed supervisor", "pid", pid, "data_dir", dir)
		if left := stopPids(ctx, clk, []int{pid}, syscall.SIGQUIT, orphanGrace); len(left) > 0 {
			if left = stopPids(ctx, clk, left, syscall.SIGKILL, orphanGrace); len(left) > 0 {
				return fmt.Errorf("data directory %s: cannot stop the orphaned postgres (pid %d) a killed supervisor left running", dir, pid)
			}
		}
	}
	if pids := postgresProcsIn(real); len(pids) > 0 {
		log.Info("killing leftover postgres processes", "pids", pids, "data_dir", dir)
		if left := stopPids(ctx, clk, pids, syscall.SIGKILL, orphanGrace); len(left) > 0 {
			return fmt.Errorf("data directory %s: cannot stop leftover postgres processes %v", dir, left)
		}
	}
	if b != nil {
		if err := os.Remove(pidFile); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("data directory %s: cannot remove stale postmaster.pid: %w", dir, err)
		}
	}
	return nil
}
