package cli_test

import (
	"bytes"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// TestConsole runs console on a pseudo-terminal against the echo shell:
// raw mode while it runs, the terminal's size at the start and after a
// resize, input and output, exit 0 on exit, the terminal restored.
func TestConsole(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	// In lower case, as ssh would give it: console restores the case.
	r := startOnPTY(t, f.env(), 33, 111, "console", "--node", strings.ToLower(f.node))
	waitFor(t, &r.screen, "$ ")
	require.NotEqual(t, r.before, r.state(t), "raw mode while the shell runs")
	require.Contains(t, r.stderr.String(), "connected to "+f.node+"; Ctrl-] detaches\n")

	tickets := f.ticketRequestsSeen()
	require.Len(t, tickets, 1)
	require.Equal(t, f.node, tickets[0].GetNodeId())
	require.Equal(t, tunnel.PurposeShell, tickets[0].GetPurpose())
	opens := f.openings()
	require.Len(t, opens, 1)
	require.Equal(t, map[string][]string{"node": {f.node}, "rows": {"33"}, "cols": {"111"}}, map[string][]string(opens[0].query))
	require.Equal(t, "Bearer "+fakeToken, opens[0].header.Get("Authorization"))
	require.Equal(t, fakeTenant, opens[0].header.Get("X-BC-Tenant"))

	r.typeIn(t, "size\r")
	waitFor(t, &r.screen, "33 111\r\n")

	// The kernel sends SIGWINCH to the terminal's foreground process: the
	// CLI.
	require.NoError(t, pty.Setsize(r.ptmx, &pty.Winsize{Rows: 40, Cols: 120}))
	require.Eventually(t, func() bool { return len(f.resizesSent()) == 1 }, waitTimeout, 5*time.Millisecond)
	require.Equal(t, []string{"40x120"}, f.resizesSent())
	r.typeIn(t, "size\r")
	waitFor(t, &r.screen, "40 120\r\n")

	r.typeIn(t, "hello, machine\r")
	waitFor(t, &r.screen, "hello, machine\r\n")
	// Ctrl-C is a key like any other in raw mode: it goes to the machine.
	r.typeIn(t, "\x03\r")
	waitFor(t, &r.screen, "\x03\r\n")

	r.typeIn(t, "exit\r")
	require.Equal(t, 0, r.wait(t), r.stderr.String())
	r.requireRestored(t)
	require.Empty(t, f.closesSent(), "the shell ended the tunnel")
}

// TestConsoleEnds: how console ends, on a pseudo-terminal, each with the
// terminal restored.
func TestConsoleEnds(t *testing.T) {
	t.Parallel()
	start := func(t *testing.T) (*fakeTunnels, *ptyRun) {
		t.Helper()
		f := newFakeTunnels(t)
		r := startOnPTY(t, f.env(), 24, 80, "console", "--node", f.node)
		waitFor(t, &r.screen, "$ ")
		return f, r
	}
	t.Run("false exits 1", func(t *testing.T) {
		t.Parallel()
		_, r := start(t)
		r.typeIn(t, "false\r")
		require.Equal(t, 1, r.wait(t), r.stderr.String())
		r.requireRestored(t)
	})
	t.Run("Ctrl-] detaches", func(t *testing.T) {
		t.Parallel()
		f, r := start(t)
		r.typeIn(t, "ab\x1dnot sent")
		require.Equal(t, 0, r.wait(t), r.stderr.String())
		r.requireRestored(t)
		require.True(t, strings.HasSuffix(r.stderr.String(), "\r\ndetached from "+f.node+"\n"), "%q", r.stderr.String())
		require.Equal(t, []string{"detached"}, f.closesSent())
		require.Equal(t, "ab", string(bytes.Join(f.dataSent(), nil)), "what came before Ctrl-], and nothing after")
	})
	t.Run("a close with a reason", func(t *testing.T) {
		t.Parallel()
		_, r := start(t)
		r.typeIn(t, "close\r")
		require.Equal(t, 255, r.wait(t), r.stderr.String())
		r.requireRestored(t)
		require.True(t, strings.HasSuffix(r.stderr.String(), "\r\nconsole: "+fakeCloseReason+"\n"), "%q", r.stderr.String())
	})
	t.Run("a dropped connection", func(t *testing.T) {
		t.Parallel()
		_, r := start(t)
		r.typeIn(t, "drop\r")
		require.Equal(t, 255, r.wait(t), r.stderr.String())
		r.requireRestored(t)
		require.Contains(t, r.stderr.String(), "\r\nconsole: lost the connection to the API server: ")
	})
	t.Run("SIGTERM", func(t *testing.T) {
		t.Parallel()
		f, r := start(t)
		require.NoError(t, r.cmd.Process.Signal(syscall.SIGTERM))
		require.Equal(t, 255, r.wait(t), r.stderr.String())
		r.requireRestored(t)
		require.True(t, strings.HasSuffix(r.stderr.String(), "\r\nconsole: interrupted\n"), "%q", r.stderr.String())
		require.Equal(t, []string{"interrupted"}, f.closesSent())
	})
}

// TestConsoleWithoutTerminal: input that is not a terminal flows as it
// comes, with no size and no resize.
func TestConsoleWithoutTerminal(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	r := startCLI(t, f.env(), "console", "--node", f.node)
	_, err := r.stdin.Write([]byte("size\n"))
	require.NoError(t, err)
	waitFor(t, &r.stdout, "$ 24 80\r\n$ ")
	_, err = r.stdin.Write([]byte("exit\n"))
	require.NoError(t, err)
	require.Equal(t, 0, r.wait(t), r.stderr.String())
	require.Empty(t, r.stderr.String(), "no terminal: nothing to say")
	require.Equal(t, map[string][]string{"node": {f.node}}, map[string][]string(f.openings()[0].query))
	require.Empty(t, f.resizesSent())
}

// TestConsolePipedInputEnds: the end of input that is not a terminal is
// sent as the tunnel's EndOfInput after what came before it, the shell
// ends, and console exits with its status instead of waiting.
func TestConsolePipedInputEnds(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	r := startCLI(t, f.env(), "console", "--node", f.node)
	_, err := r.stdin.Write([]byte("hello\n"))
	require.NoError(t, err)
	waitFor(t, &r.stdout, "$ hello\r\n$ ")
	require.NoError(t, r.stdin.Close())
	require.Equal(t, 0, r.wait(t), r.stderr.String())
	sent := f.sent()
	require.NotEmpty(t, sent)
	require.NotNil(t, sent[len(sent)-1].GetEndOfInput(), "the last frame sent is the end of the input: %v", sent)
}

// TestConsolePipedInputIsData: in input that is not a terminal, Ctrl-]
// (0x1d) is data like any byte: it goes to the machine, and console does
// not detach.
func TestConsolePipedInputIsData(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	r := startCLI(t, f.env(), "console", "--node", f.node)
	_, err := r.stdin.Write([]byte("ab\x1dcd\n"))
	require.NoError(t, err)
	waitFor(t, &r.stdout, "$ ab\x1dcd\r\n$ ")
	_, err = r.stdin.Write([]byte("exit\n"))
	require.NoError(t, err)
	require.Equal(t, 0, r.wait(t), r.stderr.String())
	require.NotContains(t, r.stderr.String(), "detached")
	require.Empty(t, f.closesSent(), "the shell ended the tunnel")
	require.Equal(t, "ab\x1dcd\nexit\n", string(bytes.Join(f.dataSent(), nil)))
}

// TestConsoleRefused: the API's errors before the tunnel opens are the
// CLI's error line, and exit 255.
func TestConsoleRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		refusal *fakeRefusal
		node    string // default: the fake's node
		stderr  string
	}{
		{name: "no live session", refusal: &fakeRefusal{status: http.StatusConflict, json: "failed_precondition",
			text: "node has no live session"},
			stderr: "error: tunnel refused: failed_precondition: node has no live session (HTTP 409)\n"},
		{name: "a proxy's text", refusal: &fakeRefusal{status: http.StatusBadGateway, text: "upstream unreachable\n"},
			stderr: "error: tunnel refused: upstream unreachable (HTTP 502)\n"},
		{name: "a limit", refusal: &fakeRefusal{status: http.StatusTooManyRequests, text: "too many open tunnels on the node",
			retryAfter: "30"}, stderr: "error: tunnel refused: too many open tunnels on the node (HTTP 429; retry after 30s)\n"},
		{name: "no reason given", refusal: &fakeRefusal{status: http.StatusForbidden},
			stderr: "error: tunnel refused: forbidden (HTTP 403)\n"},
		{name: "unknown node", node: "node_01J00000000000000000000000",
			stderr: "error: not_found: --node: node node_01J00000000000000000000000 not found\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFakeTunnels(t)
			f.setRefusal(tc.refusal)
			node := tc.node
			if node == "" {
				node = f.node
			}
			require.NoError(t, ids.Check(ids.Node, node))
			res := runner{env: f.env()}.run(t, "console", "--node", node)
			require.Equal(t, 255, res.code)
			require.Equal(t, tc.stderr, res.stderr)
			require.Empty(t, res.stdout)
		})
	}
}

// TestNodeCompletion: --node completes with the ids of the nodes the
// caller sees.
func TestNodeCompletion(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	for _, cmd := range []string{"console", "ssh-proxy", "ssh-cert"} {
		res := runner{env: f.env()}.run(t, "__complete", cmd, "--node", "NODE_")
		require.Equal(t, 0, res.code, res.stderr)
		require.Equal(t, f.node+"\tgpu-1, adopted\n:4\n", res.stdout, cmd)
	}
}
