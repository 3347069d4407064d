package cli_test

import (
	"context"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/stretchr/testify/require"
	"golang.org/x/term"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
	"github.com/better-compute/better-compute/pkg/clock"
)

// cliSubprocessEnv set to 1 makes the test binary run as the CLI
// (TestMain): the pseudo-terminal tests run it so, as a process of its own
// whose controlling terminal is the pty, the one the kernel sends SIGWINCH.
const cliSubprocessEnv = "BC_CLI_TEST_SUBPROCESS"

// runCLISubprocess is main.go's main without os.Exit.
func runCLISubprocess() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	return cli.Run(ctx, os.Args[1:], cli.OSEnv())
}

// waitTimeout bounds every wait of these tests.
const waitTimeout = 20 * time.Second

// waitFor waits until buf holds want.
func waitFor(t *testing.T, buf *syncBuffer, want string) {
	t.Helper()
	require.Eventually(t, func() bool { return strings.Contains(buf.String(), want) }, waitTimeout, 5*time.Millisecond,
		"waiting for %q in %q", want, buf)
}

// liveRun is the CLI running in-process, its stdin a pipe.
type liveRun struct {
	stdin          *io.PipeWriter
	stdout, stderr syncBuffer
	done           chan struct{}
	code           int
}

// startCLI runs the CLI with env and args in-process until it returns (or
// the test ends: its context is then cancelled).
func startCLI(t *testing.T, env map[string]string, args ...string) *liveRun {
	t.Helper()
	pr, pw := io.Pipe()
	r := &liveRun{stdin: pw, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.code = cli.Run(t.Context(), args, cli.Env{Stdin: pr, Stdout: &r.stdout, Stderr: &r.stderr,
			Getenv: func(k string) string { return env[k] }, Clock: clock.New()})
	}()
	t.Cleanup(func() {
		_ = pw.Close()
		<-r.done
	})
	return r
}

// wait returns the exit code once the run has ended.
func (r *liveRun) wait(t *testing.T) int {
	t.Helper()
	waitClosed(t, r.done)
	return r.code
}

func waitClosed(t *testing.T, ch <-chan struct{}) {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}, waitTimeout, 5*time.Millisecond)
}

// ptyRun is the CLI running as a subprocess on a pseudo-terminal: its stdin
// and stdout are the pty's terminal (its controlling terminal), its stderr
// a buffer.
type ptyRun struct {
	cmd       *exec.Cmd
	ptmx, tty *os.File
	// screen is what the CLI wrote to the terminal.
	screen syncBuffer
	stderr syncBuffer
	// before is the terminal's state before the CLI started.
	before *term.State
	waited chan struct{}
	code   int
}

// startOnPTY runs the CLI with env and args on a new pty of rows × cols.
func startOnPTY(t *testing.T, env map[string]string, rows, cols uint16, args ...string) *ptyRun {
	t.Helper()
	ptmx, tty, err := pty.Open()
	require.NoError(t, err)
	require.NoError(t, pty.Setsize(ptmx, &pty.Winsize{Rows: rows, Cols: cols}))
	r := &ptyRun{ptmx: ptmx, tty: tty, waited: make(chan struct{})}
	r.before, err = term.GetState(int(tty.Fd()))
	require.NoError(t, err)

	exe, err := os.Executable()
	require.NoError(t, err)
	r.cmd = exec.Command(exe, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "BETTER_COMPUTE_") {
			r.cmd.Env = append(r.cmd.Env, kv)
		}
	}
	r.cmd.Env = append(r.cmd.Env, cliSubprocessEnv+"=1")
	for k, v := range env {
		r.cmd.Env = append(r.cmd.Env, k+"="+v)
	}
	r.cmd.Stdin, r.cmd.Stdout, r.cmd.Stderr = tty, tty, &r.stderr
	// A session of its own with the pty as its controlling terminal
	// (descriptor 0 in the child).
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	require.NoError(t, r.cmd.Start())
	go func() { _, _ = io.Copy(&r.screen, ptmx) }()
	go func() {
		_ = r.cmd.Wait()
		r.code = r.cmd.ProcessState.ExitCode()
		close(r.waited)
	}()
	t.Cleanup(func() {
		_ = r.cmd.Process.Kill()
		<-r.waited
		// With no terminal side left open, the copy of ptmx ends.
		_ = tty.Close()
		_ = ptmx.Close()
	})
	return r
}

// typeIn writes s to the terminal, as keys typed.
func (r *ptyRun) typeIn(t *testing.T, s string) {
	t.Helper()
	_, err := r.ptmx.Write([]byte(s))
	require.NoError(t, err)
}

// wait returns the CLI's exit code once it has exited.
func (r *ptyRun) wait(t *testing.T) int {
	t.Helper()
	waitClosed(t, r.waited)
	return r.code
}

// state is the terminal's state now.
func (r *ptyRun) state(t *testing.T) *term.State {
	t.Helper()
	st, err := term.GetState(int(r.tty.Fd()))
	require.NoError(t, err)
	return st
}

// requireRestored checks that the terminal is as it was before the CLI.
func (r *ptyRun) requireRestored(t *testing.T) {
	t.Helper()
	require.Equal(t, r.before, r.state(t), "the terminal is restored")
}
