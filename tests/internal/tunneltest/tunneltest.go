// Package tunneltest drives tunnels as a user does, for the end-to-end suites
// (compose, dev): `better-compute console` on a real pseudo-terminal, and the
// real OpenSSH client (ssh, ssh-keygen) through `better-compute ssh-proxy`.
package tunneltest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

// CLI is the better-compute binary and the environment it runs with
// (BETTER_COMPUTE_URL, _TOKEN, …).
type CLI struct {
	Path string
	Env  []string
}

// With returns c with more environment variables (KEY=VALUE).
func (c CLI) With(env ...string) CLI {
	return CLI{Path: c.Path, Env: append(append([]string(nil), c.Env...), env...)}
}

// Run runs the CLI with args and returns its standard output, standard
// error and exit code.
func (c CLI) Run(ctx context.Context, args ...string) (stdout, stderr string, code int) {
	cmd := exec.CommandContext(ctx, c.Path, args...)
	cmd.Env = c.Env
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	return o.String(), e.String(), exitCode(err)
}

func exitCode(err error) int {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.ExitCode()
	default:
		return -1
	}
}

// Console is `better-compute console` running on a pseudo-terminal.
type Console struct {
	t    *testing.T
	cmd  *exec.Cmd
	tty  *os.File // the pty's master side
	mu   sync.Mutex
	out  bytes.Buffer // everything the console printed
	read int          // how much of out Expect consumed
	done chan struct{}
	// drained is closed when the reader of tty has read it to its end:
	// what the console printed last is in out.
	drained chan struct{}
	code    int
}

// StartConsole runs `console --node node` on a new pseudo-terminal of rows
// × cols; it is killed when the test ends.
func StartConsole(t *testing.T, c CLI, node string, rows, cols uint16) *Console {
	t.Helper()
	cmd := exec.Command(c.Path, "console", "--node", node)
	cmd.Env = c.Env
	tty, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: rows, Cols: cols})
	require.NoError(t, err)
	con := &Console{t: t, cmd: cmd, tty: tty, done: make(chan struct{}), drained: make(chan struct{})}
	go func() {
		defer close(con.drained)
		buf := make([]byte, 4096)
		for {
			n, err := tty.Read(buf)
			con.mu.Lock()
			con.out.Write(buf[:n])
			con.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	go func() {
		con.code = exitCode(cmd.Wait())
		close(con.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-con.done
		tty.Close()
	})
	return con
}

// Type writes s to the terminal as keystrokes.
func (c *Console) Type(s string) {
	c.t.Helper()
	_, err := io.WriteString(c.tty, s)
	require.NoError(c.t, err)
}

// Resize changes the terminal's size (the console gets SIGWINCH).
func (c *Console) Resize(rows, cols uint16) {
	c.t.Helper()
	require.NoError(c.t, pty.Setsize(c.tty, &pty.Winsize{Rows: rows, Cols: cols}))
}

// Expect waits until the output after the last match matches re, and
// returns the match.
func (c *Console) Expect(re string, within time.Duration) string {
	c.t.Helper()
	got, ok := c.match(regexp.MustCompile(re), within)
	if !ok {
		c.t.Fatalf("console output never matched %q within %s; it printed:\n%q", re, within, c.Output())
	}
	return got
}

// ExpectRetyping types line until the output after the last match
// matches re (for what follows an asynchronous change, such as a resize: the
// console sends it on SIGWINCH, which may come after keys typed at once),
// and returns the match.
func (c *Console) ExpectRetyping(line, re string, within time.Duration) string {
	c.t.Helper()
	rx := regexp.MustCompile(re)
	deadline := wall.Now().Add(within)
	for wall.Now().Before(deadline) {
		c.Type(line)
		if got, ok := c.match(rx, time.Second); ok {
			return got
		}
	}
	c.t.Fatalf("console output never matched %q within %s; it printed:\n%q", re, within, c.Output())
	return ""
}

// match waits up to d for the output after the last match to match rx,
// consuming it; it reports nothing itself.
func (c *Console) match(rx *regexp.Regexp, d time.Duration) (string, bool) {
	deadline := wall.Now().Add(d)
	for {
		c.mu.Lock()
		rest := c.out.Bytes()[c.read:]
		if loc := rx.FindIndex(rest); loc != nil {
			got := string(rest[loc[0]:loc[1]])
			c.read += loc[1]
			c.mu.Unlock()
			return got, true
		}
		c.mu.Unlock()
		if !wall.Now().Before(deadline) || clock.Sleep(c.t.Context(), wall, 20*time.Millisecond) != nil {
			return "", false
		}
	}
}

// Output returns everything the console printed.
func (c *Console) Output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.out.String()
}

// Wait waits for the console to exit, and for what it printed to be read,
// and returns its exit code.
func (c *Console) Wait(within time.Duration) int {
	c.t.Helper()
	ok := assert.Eventually(c.t, func() bool {
		select {
		case <-c.done:
			return true
		default:
			return false
		}
	}, within, 20*time.Millisecond)
	if !ok {
		c.t.Fatalf("console did not exit within %s; it printed:\n%q", within, c.Output())
	}
	// The process has exited; its last lines may still be in the pty
	// (read returns them, then an error, once the terminal's other side
	// is closed).
	timer := wall.NewTimer(within)
	defer timer.Stop()
	select {
	case <-c.drained:
	case <-timer.C():
		c.t.Fatalf("the console's terminal was not read to its end within %s; it printed:\n%q", within, c.Output())
	}
	return c.code
}

// Key is an SSH key pair made by the real ssh-keygen, in a directory of its
// own: Path is the private key, Path+".pub" the public key, and
// Path+"-cert.pub" where `better-compute ssh-cert` writes the certificate
// and ssh looks for it.
type Key struct{ Path string }

// NewKey runs ssh-keygen for a new Ed25519 key.
func NewKey(t *testing.T) Key {
	t.Helper()
	path := filepath.Join(t.TempDir(), "id_ed25519")
	out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "e2e", "-f", path).CombinedOutput()
	require.NoError(t, err, "ssh-keygen: %s", out)
	return Key{Path: path}
}

// SSH runs the real ssh client as user@node with key (and its certificate,
// when one was written next to it) through `better-compute ssh-proxy`, with
// the remote command args, and returns its output and exit code. Host keys
// are not pinned (a fresh known_hosts each time).
func SSH(ctx context.Context, c CLI, key Key, user, node string, proxyArgs []string, args ...string) (string, int) {
	proxy := c.Path + " ssh-proxy --node %h"
	if len(proxyArgs) > 0 {
		proxy += " " + strings.Join(proxyArgs, " ")
	}
	argv := []string{"-F", "/dev/null", "-o", "ProxyCommand=" + proxy, "-o", "StrictHostKeyChecking=no",
		"-o", "UserKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
		"-o", "ConnectTimeout=20", "-o", "LogLevel=ERROR", "-i", key.Path, user + "@" + node}
	argv = append(argv, args...)
	cmd := exec.CommandContext(ctx, "ssh", argv...)
	cmd.Env = c.Env
	out, err := cmd.CombinedOutput()
	return string(out), exitCode(err)
}

// Cert runs `better-compute ssh-cert` for key on node with more args and
// fails the test when it fails.
func Cert(t *testing.T, c CLI, key Key, node string, args ...string) string {
	t.Helper()
	argv := append([]string{"ssh-cert", "--node", node, "--public-key", key.Path + ".pub"}, args...)
	out, errOut, code := c.Run(t.Context(), argv...)
	require.Equal(t, 0, code, "ssh-cert %v: %s%s", args, out, errOut)
	_, err := os.Stat(key.Path + "-cert.pub")
	require.NoError(t, err, "ssh-cert wrote no certificate next to the key")
	return out
}

// Scenario is what Exercise needs of a running deployment: the CLI as a
// root administrator, a node to open tunnels to and another node, and an
// active reservation of the root tenant on Node (for the sandbox).
type Scenario struct {
	CLI         CLI
	Node, Other string
	Reservation string
}

// Exercise runs the tunnel acceptance against a deployment, as a user does:
// console on a pseudo-terminal (size and a resize, hostname, echo, false →
// 1, exit → 0, Ctrl-] detaches), a revoked token's console closing within
// 2 s, and the real ssh through ssh-proxy with certificates from ssh-cert (a
// break-glass login and exec; refused: an expired one, another node's, a
// throwaway CA's, a sandbox one after its reservation's release).
func Exercise(t *testing.T, s Scenario) {
	t.Run("console", func(t *testing.T) { consoleScenario(t, s) })
	t.Run("revoked token closes its console", func(t *testing.T) { revokedConsole(t, s) })
	t.Run("ssh", func(t *testing.T) { sshScenario(t, s) })
}

const within = 20 * time.Second

func hostname(t *testing.T, c CLI, node string) string {
	t.Helper()
	out, errOut, code := c.Run(t.Context(), "nodes", "get", node)
	require.Equal(t, 0, code, errOut)
	var n struct {
		Hostname string `json:"hostname"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &n), out)
	require.NotEmpty(t, n.Hostname)
	return n.Hostname
}

func consoleScenario(t *testing.T, s Scenario) {
	host := hostname(t, s.CLI, s.Node)
	con := StartConsole(t, s.CLI, s.Node, 30, 100)
	con.Expect(regexp.QuoteMeta(host+"$ "), within)
	con.Type("size\r")
	con.Expect(`30 100`, within)
	con.Resize(40, 120)
	con.ExpectRetyping("size\r", `40 120`, within)
	con.Type("hostname\r")
	con.Expect(regexp.QuoteMeta(host), within)
	con.Type("hello tunnel\r")
	con.Expect(`hello tunnel\r?\n`, within)
	con.Type("false\r")
	require.Equal(t, 1, con.Wait(within), "false ends the console with status 1")

	con = StartConsole(t, s.CLI, s.Node, 24, 80)
	con.Expect(regexp.QuoteMeta(host+"$ "), within)
	con.Type("exit\r")
	require.Equal(t, 0, con.Wait(within), "exit ends it with 0")

	con = StartConsole(t, s.CLI, s.Node, 24, 80)
	con.Expect(regexp.QuoteMeta(host+"$ "), within)
	con.Type("\x1d")
	require.Equal(t, 0, con.Wait(within))
	require.Contains(t, con.Output(), "detached from "+s.Node)
}

func revokedConsole(t *testing.T, s Scenario) {
	name := "console-" + strings.ToLower(s.Node[len(s.Node)-6:])
	secret, errOut, code := s.CLI.Run(t.Context(), "tokens", "create", "--name", name, "--role", "tenant-admin")
	require.Equal(t, 0, code, errOut)
	secret = strings.TrimSpace(secret)
	out, errOut, code := s.CLI.Run(t.Context(), "tokens", "list", "-o", "json")
	require.Equal(t, 0, code, errOut)
	var toks []struct {
		ID   string `json:"id"`
		Name string `json:"name"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &toks), out)
	var id string
	for _, tk := range toks {
		if tk.Name == name {
			id = tk.ID
		}
	}
	require.NotEmpty(t, id, "the new token is listed")

	con := StartConsole(t, s.CLI.With("BETTER_COMPUTE_TOKEN="+secret), s.Node, 24, 80)
	con.Expect(`\$ `, within)
	_, errOut, code = s.CLI.Run(t.Context(), "tokens", "revoke", id)
	require.Equal(t, 0, code, errOut)
	began := wall.Now()
	require.Equal(t, 255, con.Wait(5*time.Second), "the revoked token's console ends with an error")
	took := clock.Since(wall, began)
	t.Logf("console closed %s after its token's revocation (target: 2 s)", took.Round(time.Millisecond))
	require.Less(t, took, 2*time.Second, "a revoked token's console closes within 2 s")
	require.Contains(t, con.Output(), "revoked")
}

func sshScenario(t *testing.T, s Scenario) {
	ctx := t.Context()
	host := hostname(t, s.CLI, s.Node)

	key := NewKey(t)
	Cert(t, s.CLI, key, s.Node)
	// The certificate is in the audit log with its serial.
	certJSON, errOut, code := s.CLI.Run(ctx, "ssh-cert", "--node", s.Node, "--public-key", key.Path+".pub", "-o", "json")
	require.Equal(t, 0, code, errOut)
	var issued struct {
		Serial string `json:"serial"`
	}
	require.NoError(t, json.Unmarshal([]byte(certJSON), &issued), certJSON)
	auditJSON, errOut, code := s.CLI.Run(ctx, "audit", "list", "-o", "json", "--limit", "20")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, auditJSON, "certificate serial "+issued.Serial, "audit list has the certificate")
	out, code := SSH(ctx, s.CLI, key, "root", s.Node, nil, "hostname")
	require.Equal(t, 0, code, out)
	require.Equal(t, host, strings.TrimSpace(out))
	auditJSON, errOut, code = s.CLI.Run(ctx, "audit", "list", "-o", "json", "--limit", "5")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, auditJSON, "ssh ticket tkt_", "audit list has the ssh-proxy's ticket")
	out, code = SSH(ctx, s.CLI, key, "root", s.Node, nil, "false")
	require.Equal(t, 1, code, out)

	refused := func(what string, key Key, user string, proxy ...string) {
		t.Helper()
		out, code := SSH(ctx, s.CLI, key, user, s.Node, proxy, "hostname")
		require.Equal(t, 255, code, "%s: ssh should be refused: %s", what, out)
		require.Contains(t, out, "Permission denied", what)
	}

	expired := NewKey(t)
	Cert(t, s.CLI, expired, s.Node, "--ttl", "1s")
	require.Eventually(t, func() bool {
		_, code := SSH(ctx, s.CLI, expired, "root", s.Node, nil, "true")
		return code == 255
	}, within, 500*time.Millisecond, "an expired certificate is refused")
	refused("expired certificate", expired, "root")

	other := NewKey(t)
	Cert(t, s.CLI, other, s.Other)
	refused("another node's certificate", other, "root")

	// A certificate from a CA of our own, bound to the node: refused.
	rogue := NewKey(t)
	ca := NewKey(t)
	out2, err := exec.Command("ssh-keygen", "-q", "-s", ca.Path, "-I", "rogue", "-n", "root", "-V", "+1h",
		"-O", "critical:node@better-compute="+s.Node, rogue.Path+".pub").CombinedOutput()
	require.NoError(t, err, "ssh-keygen -s: %s", out2)
	refused("a throwaway CA's certificate", rogue, "root")
	requireEvent(t, s.CLI, "node.ssh_refused", s.Node, "signed by a CA this node does not trust")

	if s.Reservation != "" {
		sandbox := NewKey(t)
		Cert(t, s.CLI, sandbox, s.Node, "--reservation", s.Reservation)
		proxy := []string{"--reservation", s.Reservation}
		out, code := SSH(ctx, s.CLI, sandbox, s.Reservation, s.Node, proxy, "hostname")
		require.Equal(t, 0, code, "the sandbox certificate logs in as its reservation: %s", out)
		_, errOut, code := s.CLI.Run(ctx, "release", s.Reservation)
		require.Equal(t, 0, code, errOut)
		require.Eventually(t, func() bool {
			_, code := SSH(ctx, s.CLI, sandbox, s.Reservation, s.Node, nil, "true")
			return code == 255
		}, within, 500*time.Millisecond, "a sandbox certificate stops working when its reservation is released")
	}
}

// requireEvent waits for `events watch --from-start --types typ` to print an
// event of subject whose data contains text.
func requireEvent(t *testing.T, c CLI, typ, subject, text string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), within)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.Path, "events", "watch", "--from-start", "--types", typ)
	cmd.Env = c.Env
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() { cancel(); _ = cmd.Wait() }()
	dec := json.NewDecoder(out)
	for {
		var e struct {
			Type      string          `json:"type"`
			SubjectID string          `json:"subjectId"`
			Data      json.RawMessage `json:"data"`
		}
		if err := dec.Decode(&e); err != nil {
			t.Fatalf("no %s event of %s saying %q within %s: %v", typ, subject, text, within, err)
		}
		if e.Type == typ && e.SubjectID == subject && strings.Contains(string(e.Data), text) {
			return
		}
	}
}

// wall is the real clock, for the figures the scenario logs.
var wall = clock.New()
