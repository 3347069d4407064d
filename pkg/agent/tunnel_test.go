package agent_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/syncbuf"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// tunnelWait is a tunnel the fake gateway asked node to open.
type tunnelWait struct {
	node string
	ch   chan *gwTunnel
}

// gwTunnel is the fake gateway's end of a node's Tunnel stream, as the
// test, the tunnel's client, uses it: tunnel.Frames toward the node
// (CloseSend ends the stream, as the gateway does when the client left).
type gwTunnel struct {
	stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]
	from   chan *tunnelv1.Frame // what the node sent; closed when its side ended
	err    error                // why from closed; read after it closed

	mu    sync.Mutex
	ended bool // the handler returned: Send fails
	done  chan struct{}
	once  sync.Once
}

// Send sends a frame to the node.
func (t *gwTunnel) Send(f *tunnelv1.Frame) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return io.EOF
	}
	return t.stream.Send(f)
}

// Receive returns the node's next frame.
func (t *gwTunnel) Receive() (*tunnelv1.Frame, error) {
	f, ok := <-t.from
	if !ok {
		return nil, t.err
	}
	return f, nil
}

// CloseSend ends the stream.
func (t *gwTunnel) CloseSend() error {
	t.once.Do(func() { close(t.done) })
	return nil
}

// Tunnel is the node's end of a tunnel: it must name a tunnel the gateway
// asked this node (by its certificate) to open.
func (g *fakeGateway) Tunnel(ctx context.Context, stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]) error {
	cert, _ := ctx.Value(peerKey{}).(*x509.Certificate)
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	start := first.GetStart()
	if start == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("first message must be start"))
	}
	node, err := pki.NodeIDFromCert(cert, trustDomain)
	if err != nil {
		return connect.NewError(connect.CodePermissionDenied, err)
	}
	g.mu.Lock()
	w, ok := g.tunnelWaits[start.GetTunnelId()]
	if ok && w.node == node {
		delete(g.tunnelWaits, start.GetTunnelId())
	}
	g.mu.Unlock()
	if !ok || w.node != node {
		return connect.NewError(connect.CodeNotFound, errors.New("no such tunnel for this node"))
	}
	t := &gwTunnel{stream: stream, from: make(chan *tunnelv1.Frame, 64), done: make(chan struct{})}
	stop := make(chan struct{})
	go func() {
		defer close(t.from)
		for {
			m, err := stream.Receive()
			if err != nil {
				t.err = err
				return
			}
			f := m.GetFrame()
			if f == nil {
				t.err = errors.New("a second start")
				return
			}
			select {
			case t.from <- f:
			case <-stop:
				t.err = io.ErrClosedPipe
				return
			}
		}
	}()
	w.ch <- t
	select {
	case <-t.done:
	case <-ctx.Done():
	}
	t.mu.Lock()
	t.ended = true
	t.mu.Unlock()
	close(stop)
	return nil
}

// openTunnel sends OpenTunnel to node and returns the tunnel once the node
// dialled it; the test's end closes it when the test ends.
func (g *fakeGateway) openTunnel(t *testing.T, node, purpose string, size *tunnelv1.TerminalSize) *gwTunnel {
	t.Helper()
	id := ids.New("tkt", clock.New().Now())
	ch := make(chan *gwTunnel, 1)
	g.mu.Lock()
	g.tunnelWaits[id] = tunnelWait{node: node, ch: ch}
	g.mu.Unlock()
	g.send(t, node, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_OpenTunnel{OpenTunnel: &gatewayv1.OpenTunnel{
		TunnelId: id, Purpose: purpose, Size: size,
	}}})
	var tun *gwTunnel
	require.Eventually(t, func() bool {
		select {
		case tun = <-ch:
			return true
		default:
			return false
		}
	}, waitFor, tick, "the node dials the tunnel back")
	t.Cleanup(func() { _ = tun.CloseSend() })
	return tun
}

// sshRefusals returns the SSH refusals node reported.
func (g *fakeGateway) sshRefusals(node string) []*gatewayv1.SshRefused {
	var out []*gatewayv1.SshRefused
	for _, m := range g.received(node) {
		if r := m.GetReport().GetSshRefused(); r != nil {
			out = append(out, r)
		}
	}
	return out
}

// shellClient is the client of a shell tunnel.
type shellClient struct {
	t      *testing.T
	tun    *gwTunnel
	out    syncbuf.Buffer
	mu     sync.Mutex
	exit   *int32 // the exit frame's status, once it came
	after  int    // frames after the exit frame
	ended  chan struct{}
	endErr error // why the node's side ended; read after ended
}

func newShellClient(t *testing.T, tun *gwTunnel) *shellClient {
	c := &shellClient{t: t, tun: tun, ended: make(chan struct{})}
	go func() {
		defer close(c.ended)
		for {
			f, err := tun.Receive()
			if err != nil {
				c.endErr = err
				return
			}
			c.mu.Lock()
			if c.exit != nil {
				c.after++
			}
			switch x := f.GetFrame().(type) {
			case *tunnelv1.Frame_Data:
				_, _ = c.out.Write(x.Data)
			case *tunnelv1.Frame_Exit:
				st := x.Exit.GetStatus()
				c.exit = &st
			}
			c.mu.Unlock()
		}
	}()
	return c
}

func (c *shellClient) typ(keys string) {
	c.t.Helper()
	require.NoError(c.t, c.tun.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: []byte(keys)}}))
}

func (c *shellClient) resize(rows, cols uint32) {
	c.t.Helper()
	require.NoError(c.t, c.tun.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Resize{Resize: &tunnelv1.TerminalSize{Rows: rows, Cols: cols}}}))
}

func (c *shellClient) waitOutput(want string) {
	c.t.Helper()
	require.Eventually(c.t, func() bool { return strings.Contains(c.out.String(), want) }, waitFor, tick,
		"output %q lacks %q", &c.out, want)
}

// waitExit waits for the exit frame and the end of the node's side, and
// returns the status.
func (c *shellClient) waitExit() int32 {
	c.t.Helper()
	require.Eventually(c.t, func() bool {
		select {
		case <-c.ended:
			return true
		default:
			return false
		}
	}, waitFor, tick, "the node ends the tunnel; output %q", &c.out)
	require.ErrorIs(c.t, c.endErr, io.EOF, "the node half-closes after the exit")
	c.mu.Lock()
	defer c.mu.Unlock()
	require.NotNil(c.t, c.exit, "an exit frame")
	require.Zero(c.t, c.after, "no frame after the exit")
	return *c.exit
}

// hostnameOf returns the fake host name of machine m.
func hostnameOf(t *testing.T, m *agent.Machine) string {
	t.Helper()
	st := m.Status()
	hw, err := fakehw.New(st.Variant, st.MachineID)
	require.NoError(t, err)
	return hw.Hostname()
}

func waitTunnels(t *testing.T, m *agent.Machine, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return m.Status().Tunnels == n }, waitFor, tick, "%d tunnels open", n)
}

// TestShellTunnel: a shell tunnel runs the machine's echo shell on the
// client's terminal: size follows resizes, hostname, echo, and the exit
// status is the last frame.
func TestShellTunnel(t *testing.T) {
	cp := newControlPlane(t, 1)
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	m := r.Machines()[0]
	node := m.NodeID()
	host := hostnameOf(t, m)

	tun := cp.gw.openTunnel(t, node, tunnel.PurposeShell, &tunnelv1.TerminalSize{Rows: 24, Cols: 80})
	c := newShellClient(t, tun)
	prompt := host + "$ "
	c.waitOutput(prompt)
	waitTunnels(t, m, 1)
	c.typ("size\r")
	c.waitOutput("size\r\n24 80\r\n" + prompt)
	c.typ("hostname\r")
	c.waitOutput("hostname\r\n" + host + "\r\n" + prompt)
	c.typ("hello\r")
	c.waitOutput("hello\r\nhello\r\n" + prompt)
	c.resize(40, 100)
	c.typ("size\r")
	c.waitOutput("size\r\n40 100\r\n" + prompt)
	c.typ("false\r")
	require.Equal(t, int32(1), c.waitExit())
	require.NoError(t, tun.CloseSend()) // the gateway ends the stream
	waitTunnels(t, m, 0)

	c = newShellClient(t, cp.gw.openTunnel(t, node, tunnel.PurposeShell, &tunnelv1.TerminalSize{Rows: 24, Cols: 80}))
	c.waitOutput(prompt)
	c.typ("exit\r")
	require.Equal(t, int32(0), c.waitExit())
}

// TestShellTunnelEndOfInput: the client's EndOfInput ends the shell's
// input as the end of a pipe would: the shell runs what it was sent, ends,
// and its exit status still reaches the client.
func TestShellTunnelEndOfInput(t *testing.T) {
	cp := newControlPlane(t, 1)
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	m := r.Machines()[0]
	host := hostnameOf(t, m)
	tun := cp.gw.openTunnel(t, m.NodeID(), tunnel.PurposeShell, nil)
	c := newShellClient(t, tun)
	c.typ("hello\r")
	require.NoError(t, tun.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_EndOfInput{EndOfInput: &tunnelv1.EndOfInput{}}}))
	require.Equal(t, int32(0), c.waitExit())
	c.waitOutput(host + "$ hello\r\nhello\r\n" + host + "$ ")
	require.NoError(t, tun.CloseSend())
	waitTunnels(t, m, 0)
}

// TestShellTunnelClientCloses: the client's Close ends the shell; the
// tunnel is gone on the node.
func TestShellTunnelClientCloses(t *testing.T) {
	cp := newControlPlane(t, 1)
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	m := r.Machines()[0]
	tun := cp.gw.openTunnel(t, m.NodeID(), tunnel.PurposeShell, &tunnelv1.TerminalSize{Rows: 24, Cols: 80})
	c := newShellClient(t, tun)
	c.waitOutput("$ ")
	require.NoError(t, tun.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: "the client detached"}}}))
	require.NoError(t, tun.CloseSend())
	waitTunnels(t, m, 0)
}

// TestTunnelsEndWithTheMachine: a reboot ends the machine's tunnels, and
// so does its stop; the machine serves new ones after the reboot.
func TestTunnelsEndWithTheMachine(t *testing.T) {
	cp := newControlPlane(t, 1)
	r, cancel := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	m := r.Machines()[0]
	node := m.NodeID()
	c := newShellClient(t, cp.gw.openTunnel(t, node, tunnel.PurposeShell, &tunnelv1.TerminalSize{Rows: 24, Cols: 80}))
	c.waitOutput("$ ")
	sc := newShellClient(t, cp.gw.openTunnel(t, node, tunnel.PurposeSSH, nil)) // an ssh tunnel nobody logs in on
	waitTunnels(t, m, 2)

	cp.gw.send(t, node, command(ids.New(ids.Command, clock.New().Now()), "node.reboot"))
	for _, x := range []*shellClient{c, sc} {
		require.Eventually(t, func() bool {
			select {
			case <-x.ended:
				return true
			default:
				return false
			}
		}, waitFor, tick, "the reboot ends the tunnel")
	}
	waitTunnels(t, m, 0)
	require.Nil(t, c.exit, "no exit status: the shell was cut off")

	require.Eventually(t, func() bool { return len(cp.gw.helloes(node)) == 2 && m.Status().Sessions == 2 }, waitFor, tick)
	c = newShellClient(t, cp.gw.openTunnel(t, node, tunnel.PurposeShell, &tunnelv1.TerminalSize{Rows: 24, Cols: 80}))
	c.waitOutput("$ ")
	cancel()
	<-r.Done()
	require.Eventually(t, func() bool {
		select {
		case <-c.ended:
			return true
		default:
			return false
		}
	}, waitFor, tick, "stopping the machine ends the tunnel")
}

// sshFixture is what the SSH tests need: a running machine whose spec
// trusts the deployment's two CAs, and a user key.
type sshFixture struct {
	cp         *controlPlane
	r          *agent.Runner
	cancel     context.CancelFunc // stops r
	m          *agent.Machine
	node       string
	gen        int64
	breakGlass *sshca.CA
	sandbox    *sshca.CA
	bgKey      ed25519.PrivateKey
	user       ssh.Signer
}

func newCA(t *testing.T, name string) (*sshca.CA, ed25519.PrivateKey) {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	ca, err := sshca.NewCA(name, key)
	require.NoError(t, err)
	return ca, key
}

func setupSSH(t *testing.T, dir string) *sshFixture {
	t.Helper()
	f := &sshFixture{cp: newControlPlane(t, 1)}
	f.breakGlass, f.bgKey = newCA(t, sshca.BreakGlass)
	f.sandbox, _ = newCA(t, sshca.Sandbox)
	_, userKey, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	f.user, err = ssh.NewSignerFromKey(userKey)
	require.NoError(t, err)
	f.start(t, dir)
	f.spec(t)
	return f
}

// start runs the machine of dir until the test ends (or f.cancel).
func (f *sshFixture) start(t *testing.T, dir string) {
	t.Helper()
	r, cancel := start(t, f.cp.config(dir, 1), agent.Deps{})
	waitEstablished(t, r)
	f.r, f.cancel, f.m = r, cancel, r.Machines()[0]
	f.node = f.m.NodeID()
}

// spec applies the next NodeSpec generation: both CAs and an allocation
// for each reservation.
func (f *sshFixture) spec(t *testing.T, reservations ...string) {
	t.Helper()
	f.gen++
	spec := &gatewayv1.NodeSpec{SshUserCas: []*gatewayv1.SshUserCa{f.breakGlass.UserCA(), f.sandbox.UserCA()}}
	for i, res := range reservations {
		spec.Allocations = append(spec.Allocations, &gatewayv1.Allocation{ReservationId: res, DeviceIndexes: []int32{int32(i)}})
	}
	f.cp.gw.send(t, f.node, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_DesiredState{DesiredState: &gatewayv1.DesiredState{
		Generation: f.gen, Spec: spec,
	}}})
	require.Eventually(t, func() bool { return f.m.Status().ObservedGeneration == f.gen }, waitFor, tick)
}

// cert returns a signer presenting a certificate of ca for principal on
// node.
func (f *sshFixture) cert(t *testing.T, ca *sshca.CA, node, principal string) ssh.Signer {
	t.Helper()
	now := clock.New().Now()
	cert, err := ca.Issue(sshca.Request{Key: f.user.PublicKey(), NodeID: node, Principal: principal,
		KeyID: "tok_test for " + principal + " on " + node, ValidBefore: now.Add(10 * time.Minute)}, now)
	require.NoError(t, err)
	s, err := ssh.NewCertSigner(cert, f.user)
	require.NoError(t, err)
	return s
}

// expiredCert returns a signer presenting a break-glass certificate for
// root on the node that expired an hour ago (sshca issues no such thing;
// the test signs it with the CA's key).
func (f *sshFixture) expiredCert(t *testing.T) ssh.Signer {
	t.Helper()
	now := clock.New().Now()
	cert := &ssh.Certificate{
		Key: f.user.PublicKey(), Serial: 7, CertType: ssh.UserCert, KeyId: "expired for root",
		ValidPrincipals: []string{sshca.RootPrincipal},
		ValidAfter:      uint64(now.Add(-2 * time.Hour).Unix()), ValidBefore: uint64(now.Add(-time.Hour).Unix()),
		Permissions: ssh.Permissions{CriticalOptions: map[string]string{sshca.NodeOption: f.node}},
	}
	caSigner, err := ssh.NewSignerFromKey(f.bgKey)
	require.NoError(t, err)
	require.NoError(t, cert.SignCert(rand.Reader, caSigner))
	s, err := ssh.NewCertSigner(cert, f.user)
	require.NoError(t, err)
	return s
}

// dial opens an ssh tunnel to the node and logs in as user with signer;
// it returns the client and the host key the node presented.
func (f *sshFixture) dial(t *testing.T, user string, signer ssh.Signer) (*ssh.Client, ssh.PublicKey, error) {
	t.Helper()
	conn := tunnel.NewConn(f.cp.gw.openTunnel(t, f.node, tunnel.PurposeSSH, nil))
	var hostKey ssh.PublicKey
	cc, chans, reqs, err := ssh.NewClientConn(conn, "node", &ssh.ClientConfig{
		User: user,
		Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: func(_ string, _ net.Addr, k ssh.PublicKey) error {
			hostKey = k
			return nil
		},
	})
	if err != nil {
		_ = conn.Close()
		return nil, hostKey, err
	}
	c := ssh.NewClient(cc, chans, reqs)
	t.Cleanup(func() { _ = c.Close() })
	return c, hostKey, nil
}

// run runs command in a new session of c and returns its output and exit
// status.
func run(t *testing.T, c *ssh.Client, command string) (string, int) {
	t.Helper()
	s, err := c.NewSession()
	require.NoError(t, err)
	defer s.Close()
	out, err := s.Output(command)
	var exit *ssh.ExitError
	if errors.As(err, &exit) {
		return string(out), exit.ExitStatus()
	}
	require.NoError(t, err)
	return string(out), 0
}

// TestSSHBreakGlass: root logs in with a break-glass certificate for this
// node; exec runs one line of the machine's shell with its exit status;
// no port forwarding, no subsystem; the host key is the machine's, 0600,
// and the same after a restart.
func TestSSHBreakGlass(t *testing.T) {
	dir := t.TempDir()
	f := setupSSH(t, dir)
	host := hostnameOf(t, f.m)
	c, hostKey, err := f.dial(t, "root", f.cert(t, f.breakGlass, f.node, "root"))
	require.NoError(t, err)
	out, status := run(t, c, "hostname")
	require.Equal(t, host+"\n", out)
	require.Zero(t, status)
	out, status = run(t, c, "false")
	require.Empty(t, out)
	require.Equal(t, 1, status)
	out, status = run(t, c, "hello there")
	require.Equal(t, "hello there\n", out)
	require.Zero(t, status)

	_, err = c.Dial("tcp", "127.0.0.1:22")
	require.Error(t, err, "no port forwarding")
	s, err := c.NewSession()
	require.NoError(t, err)
	require.Error(t, s.RequestSubsystem("sftp"), "no subsystem")
	require.NoError(t, s.Close())
	require.NoError(t, c.Close())
	require.Empty(t, f.cp.gw.sshRefusals(f.node))
	waitTunnels(t, f.m, 0)

	keyFile := filepath.Join(f.m.Dir(), agent.HostKeyFile)
	fi, err := os.Stat(keyFile)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	signer, err := ssh.ParsePrivateKey(mustRead(t, keyFile))
	require.NoError(t, err)
	require.Equal(t, ssh.KeyAlgoED25519, hostKey.Type())
	require.Equal(t, hostKey.Marshal(), signer.PublicKey().Marshal(), "the host key is the file's")

	// A restart keeps the host key.
	f.cancel()
	<-f.r.Done()
	f.start(t, dir)
	f.gen = 0
	f.spec(t)
	c, again, err := f.dial(t, "root", f.cert(t, f.breakGlass, f.node, "root"))
	require.NoError(t, err)
	require.Equal(t, hostKey.Marshal(), again.Marshal(), "the same host key after a restart")
	out, status = run(t, c, "hostname")
	require.Equal(t, host+"\n", out)
	require.Zero(t, status)
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

// TestSSHInteractiveShell: a pty and a shell: the echo shell at the pty's
// size, following window changes, with its exit status.
func TestSSHInteractiveShell(t *testing.T) {
	f := setupSSH(t, t.TempDir())
	c, _, err := f.dial(t, "root", f.cert(t, f.breakGlass, f.node, "root"))
	require.NoError(t, err)
	s, err := c.NewSession()
	require.NoError(t, err)
	defer s.Close()
	var out syncbuf.Buffer
	s.Stdout = &out
	in, err := s.StdinPipe()
	require.NoError(t, err)
	require.Error(t, s.Setenv("LANG", "C"), "env is refused, and the session goes on")
	require.NoError(t, s.RequestPty("xterm", 30, 90, ssh.TerminalModes{}))
	require.NoError(t, s.Shell())
	prompt := hostnameOf(t, f.m) + "$ "
	wait := func(want string) {
		t.Helper()
		require.Eventually(t, func() bool { return strings.Contains(out.String(), want) }, waitFor, tick, "output %q lacks %q", &out, want)
	}
	wait(prompt)
	_, err = io.WriteString(in, "size\r")
	require.NoError(t, err)
	wait("size\r\n30 90\r\n" + prompt)
	require.NoError(t, s.WindowChange(50, 120))
	// A window change is a channel request, not data: the server may read
	// input typed after it first (as any SSH server may), so ask again
	// until the shell has it.
	require.Eventually(t, func() bool {
		if strings.Contains(out.String(), "size\r\n50 120\r\n") {
			return true
		}
		_, err := io.WriteString(in, "size\r")
		return err == nil && false
	}, waitFor, 20*time.Millisecond, "output %q", &out)
	_, err = io.WriteString(in, "exit\r")
	require.NoError(t, err)
	require.NoError(t, s.Wait(), "exit status 0")
}

// TestSSHRefusals: every login sshca.Authorize refuses is refused and
// reported on the session with the reason, the certificate's key id and
// the user.
func TestSSHRefusals(t *testing.T) {
	f := setupSSH(t, t.TempDir())
	stranger, _ := newCA(t, sshca.BreakGlass)
	for _, tc := range []struct {
		name   string
		user   string
		signer ssh.Signer
		reason string
		keyID  string
	}{
		{"a plain key", "root", f.user, "not a certificate", ""},
		{"an expired certificate", "root", f.expiredCert(t), "expired", "expired for root"},
		{"another node's certificate", "root", f.cert(t, f.breakGlass, "node_other", "root"),
			"bound to node node_other, not this node", "tok_test for root on node_other"},
		{"a CA not in the spec", "root", f.cert(t, stranger, f.node, "root"),
			"signed by a CA this node does not trust", "tok_test for root on " + f.node},
		{"a sandbox certificate for a reservation not on the node", "res_absent", f.cert(t, f.sandbox, f.node, "res_absent"),
			"reservation res_absent is not on this node", "tok_test for res_absent on " + f.node},
		{"a break-glass certificate as another user", "res_absent", f.cert(t, f.breakGlass, f.node, "root"),
			"not in the set of valid principals", "tok_test for root on " + f.node},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(f.cp.gw.sshRefusals(f.node))
			_, _, err := f.dial(t, tc.user, tc.signer)
			require.ErrorContains(t, err, "unable to authenticate")
			require.Eventually(t, func() bool { return len(f.cp.gw.sshRefusals(f.node)) == before+1 }, waitFor, tick)
			r := f.cp.gw.sshRefusals(f.node)[before]
			require.Contains(t, r.GetReason(), tc.reason)
			require.Equal(t, tc.keyID, r.GetKeyId())
			require.Equal(t, tc.user, r.GetUser())
		})
	}
	waitTunnels(t, f.m, 0)
}

// TestSSHSandbox: a sandbox certificate logs in as its reservation while
// the reservation is in the node's spec: refused before, accepted once the
// spec has it, and after the spec drops it refused again and the open
// connection closed.
func TestSSHSandbox(t *testing.T) {
	f := setupSSH(t, t.TempDir())
	signer := f.cert(t, f.sandbox, f.node, "res_sb")
	_, _, err := f.dial(t, "res_sb", signer)
	require.ErrorContains(t, err, "unable to authenticate")

	f.spec(t, "res_sb")
	c, _, err := f.dial(t, "res_sb", signer)
	require.NoError(t, err)
	out, status := run(t, c, "hostname")
	require.Equal(t, hostnameOf(t, f.m)+"\n", out)
	require.Zero(t, status)
	closed := make(chan struct{})
	go func() {
		_ = c.Wait() // why the connection ended: the node closed it
		close(closed)
	}()

	f.spec(t) // res_sb ends
	require.Eventually(t, func() bool {
		select {
		case <-closed:
			return true
		default:
			return false
		}
	}, waitFor, tick, "the node closes the connection of a reservation that left its spec")
	_, _, err = f.dial(t, "res_sb", signer)
	require.ErrorContains(t, err, "unable to authenticate")
	require.Eventually(t, func() bool { return len(f.cp.gw.sshRefusals(f.node)) == 2 }, waitFor, tick, "both refusals reported")
	for _, r := range f.cp.gw.sshRefusals(f.node) {
		require.Equal(t, "reservation res_sb is not on this node", r.GetReason())
		require.Equal(t, "res_sb", r.GetUser())
	}
	waitTunnels(t, f.m, 0)
}

// TestMaxTunnels: a tunnel beyond MaxTunnels is closed at once, saying
// why; the others stay open.
func TestMaxTunnels(t *testing.T) {
	cp := newControlPlane(t, 1)
	r, _ := start(t, cp.config(t.TempDir(), 1), agent.Deps{})
	waitEstablished(t, r)
	m := r.Machines()[0]
	for range agent.MaxTunnels {
		cp.gw.openTunnel(t, m.NodeID(), tunnel.PurposeSSH, nil) // nobody logs in
	}
	waitTunnels(t, m, agent.MaxTunnels)
	extra := cp.gw.openTunnel(t, m.NodeID(), tunnel.PurposeSSH, nil)
	_, err := io.ReadAll(tunnel.NewConn(extra))
	var closed *tunnel.ClosedError
	require.ErrorAs(t, err, &closed)
	require.Equal(t, "too many tunnels open on this machine", closed.Reason)
	require.NoError(t, extra.CloseSend()) // as the gateway ends a tunnel the node closed
	waitTunnels(t, m, agent.MaxTunnels)
}
