// Package procs runs the project's service binaries (bin/linux, `make
// build`) as processes of a test, so that a test can kill one (SIGKILL, as
// a crash or an OOM kill does) or read its CPU and memory apart from the
// test's own.
package procs

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// FreeAddr returns a free 127.0.0.1:port.
func FreeAddr(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	addr := ln.Addr().String()
	require.NoError(tb, ln.Close())
	return addr
}

// listenSettings are the address settings of each service whose defaults
// are fixed ports (docs/configuration.md).
var listenSettings = map[string][]string{
	"api":         {"BETTER_COMPUTE_LISTEN"},
	"joinservice": {"BETTER_COMPUTE_LISTEN"},
	"gateway":     {"BETTER_COMPUTE_LISTEN", "BETTER_COMPUTE_HEALTH_LISTEN", "BETTER_COMPUTE_CONTROL_LISTEN"},
	"scheduler":   {"BETTER_COMPUTE_HEALTH_LISTEN"},
	"controllers": {"BETTER_COMPUTE_HEALTH_LISTEN"},
	"fakedaemon":  {"BETTER_COMPUTE_HEALTH_LISTEN"},
}

// freeListens returns a free loopback address ("KEY=127.0.0.1:PORT") for
// each address setting of the service name that env does not set, so that
// no process a test starts binds a fixed port another one holds (two
// gateways of one test, or a test beside a running stack).
func freeListens(tb testing.TB, name string, env []string) []string {
	tb.Helper()
	var out []string
	for _, key := range listenSettings[name] {
		if !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, key+"=") }) {
			out = append(out, key+"="+FreeAddr(tb))
		}
	}
	return out
}

// Binary returns the path of bin/linux/<name> at the repository root and
// fails the test when it was not built (run `make build`).
func Binary(tb testing.TB, name string) string {
	tb.Helper()
	_, file, _, _ := runtime.Caller(0)
	bin := filepath.Join(filepath.Dir(file), "..", "..", "..", "bin", "linux", name)
	_, err := os.Stat(bin)
	require.NoError(tb, err, "%s binary (run make build)", name)
	return bin
}

// Proc is a running service process.
type Proc struct {
	name string
	cmd  *exec.Cmd
	// done is closed once the process exited; err is then its Wait error.
	done   chan struct{}
	err    error
	once   sync.Once
	paused atomic.Bool // stopped by Pause and not resumed
}

// Start runs the service bin/linux/<name> with the test's environment plus
// env ("KEY=value"), its stderr to the test's stderr, and waits until
// http://<probes>/readyz answers 200: its dependencies answer (env must make
// it serve there: BETTER_COMPUTE_HEALTH_LISTEN for the gateway,
// BETTER_COMPUTE_LISTEN for the other services). The process is
// interrupted and waited for when the test ends, unless it was killed
// before.
func Start(tb testing.TB, name, probes string, env ...string) *Proc {
	tb.Helper()
	p := Launch(tb, name, nil, env...)
	p.wait(tb, "http://"+probes+"/readyz", 30*time.Second, "ready")
	return p
}

// Launch runs bin/linux/<name> with args, the test's environment plus env
// ("KEY=value") and its stderr to the test's stderr, and returns at once
// (WaitHealthy waits for it to serve). The process is interrupted and
// waited for when the test ends, unless it was killed before.
func Launch(tb testing.TB, name string, args []string, env ...string) *Proc {
	tb.Helper()
	cmd := exec.Command(Binary(tb, name), args...)
	cmd.Env = append(append(os.Environ(), freeListens(tb, name, env)...), env...)
	cmd.Stderr = os.Stderr
	require.NoError(tb, cmd.Start())
	p := &Proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	tb.Cleanup(p.Stop)
	return p
}

// WaitHealthy waits up to within until http://<health>/healthz answers
// 200, and fails the test if it does not, or at once if the process exits
// first (with its exit status).
func (p *Proc) WaitHealthy(tb testing.TB, health string, within time.Duration) {
	tb.Helper()
	p.wait(tb, "http://"+health+"/healthz", within, "healthy")
}

// wait waits up to within until url answers 200 (the process is what),
// failing the test as WaitHealthy says.
func (p *Proc) wait(tb testing.TB, url string, within time.Duration, what string) {
	tb.Helper()
	var exited atomic.Bool
	require.Eventually(tb, func() bool {
		select {
		case <-p.done:
			exited.Store(true)
			return true
		default:
		}
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, within, 50*time.Millisecond, "%s %s at %s", p.name, what, url)
	if exited.Load() {
		tb.Fatalf("%s exited before it was %s: %v", p.name, what, p.err)
	}
}

// PID is the process id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Kill kills the process with SIGKILL (no shutdown: its sessions, leases and
// buffered writes are left as a crash leaves them) and waits for it.
func (p *Proc) Kill() { p.signal(syscall.SIGKILL) }

// Stop interrupts the process (a graceful shutdown) and waits for it; a
// paused process is resumed first, so that it can shut down.
func (p *Proc) Stop() { p.signal(os.Interrupt) }

// Pause stops the process with SIGSTOP, as `docker pause` freezes a
// container: it runs nothing and answers nothing, while the kernel keeps
// its connections open and acknowledges what arrives until the buffers
// are full. Resume (or the end of the test) lets it go on.
func (p *Proc) Pause(tb testing.TB) {
	tb.Helper()
	require.NoError(tb, p.cmd.Process.Signal(syscall.SIGSTOP))
	p.paused.Store(true)
}

// Resume continues a paused process (SIGCONT).
func (p *Proc) Resume(tb testing.TB) {
	tb.Helper()
	if p.paused.Swap(false) {
		require.NoError(tb, p.cmd.Process.Signal(syscall.SIGCONT))
	}
}

// signal sends sig once (unless the process already exited), resuming a
// paused process, and waits for the process to exit.
func (p *Proc) signal(sig os.Signal) {
	p.once.Do(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Signal(sig)
			if p.paused.Swap(false) {
				_ = p.cmd.Process.Signal(syscall.SIGCONT)
			}
		}
	})
	<-p.done
}
