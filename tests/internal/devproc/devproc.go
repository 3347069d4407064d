// Package devproc runs `better-compute dev` (bin/linux/better-compute,
// `make build`) as a subprocess of a test or benchmark, the way a user
// starts it in a terminal: it reads the startup and progress lines dev
// prints on standard output, the warnings and errors it prints on standard
// error, the CLI environment it writes to .better-compute/dev.env, and the
// processes it started.
package devproc

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/tests/internal/procs"
)

// Wall is the clock the package waits on.
var Wall = clock.New()

// Dev is a running `better-compute dev`.
type Dev struct {
	tb  testing.TB
	cmd *exec.Cmd
	// Dir is its working directory (where .better-compute/ is).
	Dir string

	stdoutPipe io.ReadCloser

	mu sync.Mutex
	// lines are the lines of both outputs as they came, stdout and stderr
	// each's own.
	lines, stdout, stderr []string
	more                  chan struct{} // signalled on each line
	done                  chan struct{} // closed when the process exited
	err                   error
}

// Start runs `better-compute dev args…` in dir (a new directory from
// WorkDir when empty) with the test's environment plus env ("KEY=value").
// The process is stopped (SIGTERM) when the test ends, unless it exited.
func Start(tb testing.TB, dir string, env []string, args ...string) *Dev {
	tb.Helper()
	if dir == "" {
		dir = WorkDir(tb)
	}
	cmd := exec.Command(procs.Binary(tb, "better-compute"), append([]string{"dev"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	// A test binary that is killed (a -timeout) takes its devs with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	stdout, err := cmd.StdoutPipe()
	require.NoError(tb, err)
	stderr, err := cmd.StderrPipe()
	require.NoError(tb, err)
	require.NoError(tb, cmd.Start())
	d := &Dev{tb: tb, cmd: cmd, Dir: dir, more: make(chan struct{}, 1), done: make(chan struct{}), stdoutPipe: stdout}
	var readers sync.WaitGroup
	read := func(r io.Reader, own *[]string) {
		defer readers.Done()
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			d.mu.Lock()
			d.lines = append(d.lines, sc.Text())
			*own = append(*own, sc.Text())
			d.mu.Unlock()
			select {
			case d.more <- struct{}{}:
			default:
			}
		}
	}
	readers.Add(2)
	go read(stdout, &d.stdout)
	go read(stderr, &d.stderr)
	go func() {
		// Wait closes the pipes: it runs once both were read to the end.
		readers.Wait()
		d.err = cmd.Wait()
		close(d.done)
	}()
	tb.Cleanup(func() {
		select {
		case <-d.done:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			<-d.done
		}
	})
	return d
}

// WorkDir returns a new working directory that an unprivileged user may not
// enter (mode 0700, like a home directory), so a dev run as root must still
// reach its data in it.
func WorkDir(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	require.NoError(tb, os.Chmod(dir, 0o700))
	return dir
}

// PID is dev's process id.
func (d *Dev) PID() int { return d.cmd.Process.Pid }

// Done is closed when dev exited.
func (d *Dev) Done() <-chan struct{} { return d.done }

// CloseStdout closes the reading end of dev's standard output, as a reader
// that went away (`dev | tee` interrupted) does: dev's next write to it
// meets a broken pipe.
func (d *Dev) CloseStdout() {
	_ = d.stdoutPipe.Close()
}

// Stdout returns what dev printed on standard output so far.
func (d *Dev) Stdout() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return strings.Join(d.stdout, "\n")
}

// Stderr returns what dev printed on standard error so far.
func (d *Dev) Stderr() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return strings.Join(d.stderr, "\n")
}

// Output returns what dev printed on both outputs so far, as it came.
func (d *Dev) Output() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return strings.Join(d.lines, "\n")
}

// WaitLine waits until dev printed a line matching re (on either output)
// and returns its
// submatches; it fails the test when dev exits first or after timeout.
func (d *Dev) WaitLine(re string, timeout time.Duration) []string {
	d.tb.Helper()
	rx := regexp.MustCompile(re)
	timer := Wall.NewTimer(timeout)
	defer timer.Stop()
	for seen := 0; ; {
		d.mu.Lock()
		lines := d.lines[seen:]
		seen = len(d.lines)
		d.mu.Unlock()
		for _, l := range lines {
			if m := rx.FindStringSubmatch(l); m != nil {
				return m
			}
		}
		select {
		case <-d.more:
		case <-d.done:
			d.mu.Lock()
			n := len(d.lines)
			d.mu.Unlock()
			if n == seen {
				d.tb.Fatalf("dev exited (%v) before printing /%s/:\n%s", d.err, re, d.Output())
			}
		case <-timer.C():
			d.tb.Fatalf("dev printed no /%s/ within %s:\n%s", re, timeout, d.Output())
		}
	}
}

// Wait waits up to timeout for dev to exit on its own and returns its exit
// code; it fails the test when dev is still running then.
func (d *Dev) Wait(timeout time.Duration) int {
	d.tb.Helper()
	timer := Wall.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-d.done:
		return d.cmd.ProcessState.ExitCode()
	case <-timer.C():
		d.tb.Fatalf("dev still runs %s after it started:\n%s", timeout, d.Output())
		return -1
	}
}

// Stop sends sig, waits up to a minute for dev to exit and returns its exit
// code.
func (d *Dev) Stop(sig syscall.Signal) int {
	d.tb.Helper()
	if err := d.cmd.Process.Signal(sig); err != nil {
		<-d.done
		d.tb.Fatalf("dev exited (%v) before %s:\n%s", d.err, sig, d.Output())
	}
	timer := Wall.NewTimer(time.Minute)
	defer timer.Stop()
	select {
	case <-d.done:
	case <-timer.C():
		d.tb.Fatalf("dev did not exit within a minute of %s:\n%s", sig, d.Output())
	}
	return d.cmd.ProcessState.ExitCode()
}

// Env returns the CLI environment dev wrote to .better-compute/dev.env
// ("KEY=value" items), checking the file is owner-only.
func (d *Dev) Env() []string {
	d.tb.Helper()
	path := filepath.Join(d.Dir, ".better-compute", "dev.env")
	st, err := os.Stat(path)
	require.NoError(d.tb, err)
	require.Equal(d.tb, os.FileMode(0o600), st.Mode().Perm(), "dev.env holds a root token: owner-only")
	b, err := os.ReadFile(path)
	require.NoError(d.tb, err)
	var env []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		env = append(env, strings.TrimPrefix(l, "export "))
	}
	return env
}

// CLI runs the better-compute CLI with dev's environment (as after `source
// .better-compute/dev.env`) and returns its standard output; it fails the
// test when the command fails.
func (d *Dev) CLI(args ...string) string {
	d.tb.Helper()
	cmd := exec.CommandContext(d.tb.Context(), procs.Binary(d.tb, "better-compute"), args...)
	cmd.Env = append(os.Environ(), d.Env()...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(d.tb, err, "better-compute %s: %s", strings.Join(args, " "), stderr.String())
	return string(out)
}

// Children returns the pids of the processes whose parent is pid.
func Children(tb testing.TB, pid int) []int {
	tb.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(tb, err)
	var out []int
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		// pid (comm) state ppid …; comm may hold spaces and parentheses.
		fields := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(fields) > 1 && fields[1] == strconv.Itoa(pid) {
			out = append(out, p)
		}
	}
	return out
}

// Descendants returns the pids of pid's children, their children, and so
// on.
func Descendants(tb testing.TB, pid int) []int {
	tb.Helper()
	var out []int
	for next := []int{pid}; len(next) > 0; {
		var kids []int
		for _, p := range next {
			kids = append(kids, Children(tb, p)...)
		}
		out = append(out, kids...)
		next = kids
	}
	return out
}

// DataDirOf returns the data directory of a postgres process (its -D
// argument).
func DataDirOf(tb testing.TB, pid int) string {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	require.NoError(tb, err)
	args := strings.Split(string(b), "\x00")
	for i, a := range args {
		if a == "-D" && i+1 < len(args) {
			return args[i+1]
		}
	}
	tb.Fatalf("process %d has no -D argument: %q", pid, args)
	return ""
}

// UID returns the real uid of a process.
func UID(tb testing.TB, pid int) int {
	tb.Helper()
	v := statusField(tb, pid, "Uid:")
	uid, err := strconv.Atoi(strings.Fields(v)[0])
	require.NoError(tb, err)
	return uid
}

// RSSKiB returns a process's resident set size in KiB.
func RSSKiB(tb testing.TB, pid int) int64 {
	tb.Helper()
	v := statusField(tb, pid, "VmRSS:")
	kib, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
	require.NoError(tb, err)
	return kib
}

func statusField(tb testing.TB, pid int, key string) string {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(tb, err)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key); ok {
			return v
		}
	}
	tb.Fatalf("no %s line in /proc/%d/status", key, pid)
	return ""
}

// RequireGone waits up to 10 s until none of pids is alive.
func RequireGone(tb testing.TB, pids []int) {
	tb.Helper()
	deadline := Wall.Now().Add(10 * time.Second)
	for _, pid := range pids {
		for syscall.Kill(pid, 0) == nil {
			if Wall.Now().After(deadline) {
				tb.Fatalf("process %d is still running after dev exited", pid)
			}
			require.NoError(tb, clock.Sleep(tb.Context(), Wall, 20*time.Millisecond))
		}
	}
}
