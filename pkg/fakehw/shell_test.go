package fakehw_test

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/syncbuf"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

const (
	waitFor = 5 * time.Second
	tick    = 2 * time.Millisecond
)

// shell is an echo shell running on a terminal the test types into.
type shell struct {
	t      *testing.T
	m      *fakehw.Machine
	in     *io.PipeWriter
	out    *syncbuf.Buffer
	term   *tunnel.Term
	status chan int
	cancel context.CancelFunc
}

func startShell(t *testing.T, size tunnel.Size, command string) *shell {
	t.Helper()
	m, err := fakehw.New(fakehw.VariantL40S, "machine-shell")
	require.NoError(t, err)
	pr, pw := io.Pipe()
	out := &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(t.Context())
	s := &shell{t: t, m: m, in: pw, out: out, term: tunnel.NewTerm(pr, out, size), status: make(chan int, 1), cancel: cancel}
	go func() { s.status <- m.Shell(ctx, s.term, command) }()
	t.Cleanup(func() {
		cancel()
		_ = pr.Close()
	})
	return s
}

// typ types keys, as a raw terminal sends them.
func (s *shell) typ(keys string) {
	s.t.Helper()
	_, err := io.WriteString(s.in, keys)
	require.NoError(s.t, err)
}

// waitOutput waits until the output contains want.
func (s *shell) waitOutput(want string) {
	s.t.Helper()
	require.Eventually(s.t, func() bool { return strings.Contains(s.out.String(), want) }, waitFor, tick,
		"output %q lacks %q", s.out.String(), want)
}

func (s *shell) wait() int {
	s.t.Helper()
	var status int
	require.Eventually(s.t, func() bool {
		select {
		case status = <-s.status:
			return true
		default:
			return false
		}
	}, waitFor, tick, "the shell did not end; output %q", s.out)
	return status
}

func TestEchoShell(t *testing.T) {
	t.Parallel()
	s := startShell(t, tunnel.Size{Rows: 24, Cols: 80}, "")
	prompt := s.m.Hostname() + "$ "
	s.waitOutput(prompt)
	s.typ("size\r")
	s.waitOutput("size\r\n24 80\r\n" + prompt)
	s.typ("hostname\r")
	s.waitOutput("hostname\r\n" + s.m.Hostname() + "\r\n" + prompt)
	s.typ("hello world\r")
	s.waitOutput("hello world\r\nhello world\r\n" + prompt)
	s.term.Resize(tunnel.Size{Rows: 50, Cols: 132})
	s.typ("size\r")
	s.waitOutput("size\r\n50 132\r\n")
	// Line editing: a backspace erases what it follows.
	s.typ("hellp\x7fo again\r")
	s.waitOutput("hello again\r\n" + prompt)
	s.typ("false\r")
	require.Equal(t, fakehw.StatusFalse, s.wait())
}

func TestEchoShellEnds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, keys string
		status     int
	}{
		{"exit", "exit\r", fakehw.StatusOK},
		{"exit with spaces", "  exit \r", fakehw.StatusOK},
		{"false", "false\r", fakehw.StatusFalse},
		{"Ctrl-D", "\x04", fakehw.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := startShell(t, tunnel.Size{Rows: 24, Cols: 80}, "")
			s.typ(tc.keys)
			require.Equal(t, tc.status, s.wait())
		})
	}
	t.Run("the input ends", func(t *testing.T) {
		t.Parallel()
		s := startShell(t, tunnel.Size{Rows: 24, Cols: 80}, "")
		require.NoError(t, s.in.Close())
		require.Equal(t, fakehw.StatusOK, s.wait())
	})
	t.Run("the tunnel ends", func(t *testing.T) {
		t.Parallel()
		s := startShell(t, tunnel.Size{Rows: 24, Cols: 80}, "")
		s.waitOutput("$ ")
		s.cancel()
		require.NoError(t, s.in.CloseWithError(context.Canceled))
		require.Equal(t, fakehw.StatusHangup, s.wait())
	})
}

// TestEchoShellCtrlC: Ctrl-C drops the line being typed; the shell goes on.
func TestEchoShellCtrlC(t *testing.T) {
	t.Parallel()
	s := startShell(t, tunnel.Size{Rows: 24, Cols: 80}, "")
	s.typ("dropped\x03")
	s.typ("hostname\r")
	s.waitOutput(s.m.Hostname() + "\r\n")
	require.NotContains(t, s.out.String(), "dropped\r\ndropped", "the dropped line is not run")
	s.typ("exit\r")
	require.Equal(t, fakehw.StatusOK, s.wait())
}

// TestEchoShellCommand: one line, no prompt and no echo, then its status.
func TestEchoShellCommand(t *testing.T) {
	t.Parallel()
	m, err := fakehw.New(fakehw.VariantL40S, "machine-shell")
	require.NoError(t, err)
	for _, tc := range []struct {
		name, command string
		size          tunnel.Size
		out           string
		status        int
	}{
		{"hostname", "hostname", tunnel.Size{}, m.Hostname() + "\n", fakehw.StatusOK},
		{"false", "false", tunnel.Size{}, "", fakehw.StatusFalse},
		{"exit", "exit", tunnel.Size{}, "", fakehw.StatusOK},
		{"echo", "echo me", tunnel.Size{}, "echo me\n", fakehw.StatusOK},
		{"size on a terminal", "size", tunnel.Size{Rows: 40, Cols: 120}, "40 120\r\n", fakehw.StatusOK},
		{"size without one", "size", tunnel.Size{}, "0 0\n", fakehw.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := startShell(t, tc.size, tc.command)
			require.Equal(t, tc.status, s.wait())
			require.Equal(t, tc.out, s.out.String())
		})
	}
}

// TestEchoShellCat: the command cat copies its input to its output, bytes
// as they are, until the input ends.
func TestEchoShellCat(t *testing.T) {
	t.Parallel()
	s := startShell(t, tunnel.Size{}, "cat")
	data := strings.Repeat("any bytes \x00\x1d\r\n", 10000)
	s.typ(data)
	require.NoError(t, s.in.Close())
	require.Equal(t, fakehw.StatusOK, s.wait())
	require.Equal(t, data, s.out.String())
}
