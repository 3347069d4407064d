package cli_test

import (
	"bytes"
	"crypto/rand"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// TestSSHProxy: bytes round-trip exactly, Ctrl-] among them, in data
// frames of at most tunnel.MaxChunk; the end of stdin closes the tunnel and
// exits 0; stdout holds nothing but the bytes.
func TestSSHProxy(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	res := f.reservation
	// Both ids in lower case: %h from ssh is, and %r may be.
	r := startCLI(t, f.env(), "ssh-proxy", "--node", strings.ToLower(f.node), "--reservation", strings.ToLower(res))

	data := make([]byte, 200<<10)
	_, err := rand.Read(data)
	require.NoError(t, err)
	for i := 0; i < len(data); i += 997 {
		data[i] = 0x1d // Ctrl-]: data, not a detach
	}
	written := make(chan error, 1)
	go func() {
		_, err := r.stdin.Write(data)
		written <- err
	}()
	require.Eventually(t, func() bool { return len(r.stdout.String()) >= len(data) }, waitTimeout, 5*time.Millisecond)
	require.NoError(t, <-written)
	require.True(t, bytes.Equal(data, []byte(r.stdout.String())), "the bytes came back exactly, and nothing else")
	frames := f.dataSent()
	require.Greater(t, len(frames), 1)
	for _, d := range frames {
		require.LessOrEqual(t, len(d), tunnel.MaxChunk)
	}
	require.Empty(t, f.closesSent())

	tickets := f.ticketRequestsSeen()
	require.Len(t, tickets, 1)
	require.Equal(t, f.node, tickets[0].GetNodeId())
	require.Equal(t, tunnel.PurposeSSH, tickets[0].GetPurpose())
	require.Equal(t, res, tickets[0].GetReservationId())
	require.Equal(t, map[string][]string{"node": {f.node}}, map[string][]string(f.openings()[0].query))

	// ssh closes its side.
	require.NoError(t, r.stdin.Close())
	require.Equal(t, 0, r.wait(t), r.stderr.String())
	require.Empty(t, r.stderr.String())
	require.Equal(t, []string{"closed"}, f.closesSent())
	require.Len(t, r.stdout.String(), len(data))
}

// TestSSHProxyReservationNode: with --reservation, --node defaults to the
// reservation's node (the README's `ssh-proxy --reservation res_…`); a
// --node that is another node is refused naming both, exit 255 as ssh
// expects of a ProxyCommand, before any ticket.
func TestSSHProxyReservationNode(t *testing.T) {
	t.Parallel()
	f := newFakeTunnels(t)
	r := startCLI(t, f.env(), "ssh-proxy", "--reservation", strings.ToLower(f.reservation))
	_, err := r.stdin.Write([]byte("SSH-2.0-OpenSSH_9.6\r\n"))
	require.NoError(t, err)
	waitFor(t, &r.stdout, "SSH-2.0-OpenSSH_9.6\r\n")
	require.NoError(t, r.stdin.Close())
	require.Equal(t, 0, r.wait(t), r.stderr.String())
	tickets := f.ticketRequestsSeen()
	require.Len(t, tickets, 1)
	require.Equal(t, f.node, tickets[0].GetNodeId())
	require.Equal(t, f.reservation, tickets[0].GetReservationId())

	other := ids.New(ids.Node, clock.New().Now())
	res := runner{env: f.env()}.run(t, "ssh-proxy", "--reservation", f.reservation, "--node", other)
	require.Equal(t, 255, res.code)
	require.Equal(t, "ssh-proxy: --node "+other+" is not the node of reservation "+f.reservation+" ("+f.node+
		"): drop --node, or give --node "+f.node+"\n", res.stderr)
	require.Len(t, f.ticketRequestsSeen(), 1)
}

// TestSSHProxyEnds: a Close with a reason from the far end is printed on
// stderr and exits 255; a normal close exits 0 quietly; refusals exit 255.
func TestSSHProxyEnds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		reason string
		code   int
		stderr string
	}{
		{name: "a close with a reason", reason: "idle for 30m", code: 255, stderr: "ssh-proxy: idle for 30m\n"},
		{name: "the node's end closed", reason: "closed", code: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFakeTunnels(t)
			r := startCLI(t, f.env(), "ssh-proxy", "--node", f.node)
			_, err := r.stdin.Write([]byte("SSH-2.0-OpenSSH_9.6\r\n"))
			require.NoError(t, err)
			waitFor(t, &r.stdout, "SSH-2.0-OpenSSH_9.6\r\n")
			f.kick <- tc.reason
			require.Equal(t, tc.code, r.wait(t))
			require.Equal(t, tc.stderr, r.stderr.String())
			require.Equal(t, "SSH-2.0-OpenSSH_9.6\r\n", r.stdout.String())
			require.Empty(t, f.closesSent())
		})
	}
	for _, tc := range []struct {
		name    string
		refusal *fakeRefusal
		node    string
		stderr  string
	}{
		{name: "a limit", refusal: &fakeRefusal{status: http.StatusTooManyRequests, text: "too many open tunnels for the token",
			retryAfter: "Wed, 21 Oct 2037 07:28:00 GMT"},
			stderr: "ssh-proxy: tunnel refused: too many open tunnels for the token (HTTP 429; retry after Wed, 21 Oct 2037 07:28:00 GMT)\n"},
		{name: "a used ticket", refusal: &fakeRefusal{status: http.StatusUnauthorized, text: "ticket already used"},
			stderr: "ssh-proxy: tunnel refused: ticket already used (HTTP 401)\n"},
		{name: "unknown node", node: "gpu-1.example", stderr: "ssh-proxy: not_found: --node: node gpu-1.example not found\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFakeTunnels(t)
			f.setRefusal(tc.refusal)
			node := tc.node
			if node == "" {
				node = f.node
			}
			res := runner{env: f.env()}.run(t, "ssh-proxy", "--node", node)
			require.Equal(t, 255, res.code)
			require.Equal(t, tc.stderr, res.stderr)
			require.Empty(t, res.stdout)
		})
	}
}
