package agent_test

import (
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
)

// freezeProxy forwards TCP connections to a target. Freeze stops every
// connection open at the time in both directions without closing it, as a
// paused or hung gateway does (docker pause, SIGSTOP): it reads nothing
// more from either side, so once the socket buffers are full the peer's
// writes block, and nothing ever comes back. Connections accepted later go
// through.
type freezeProxy struct {
	ln       net.Listener
	target   string
	mu       sync.Mutex
	conns    []*frozenPair
	accepted int
	wg       sync.WaitGroup
}

// frozenPair is one proxied connection; its pipes wait while frozen.
type frozenPair struct {
	down, up net.Conn
	mu       sync.Mutex
	cond     *sync.Cond
	frozen   bool
	closed   bool
}

func newFreezeProxy(t *testing.T, target string) *freezeProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &freezeProxy{ln: ln, target: target}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *freezeProxy) accept() {
	defer p.wg.Done()
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = down.Close()
			continue
		}
		c := &frozenPair{down: down, up: up}
		c.cond = sync.NewCond(&c.mu)
		p.mu.Lock()
		p.conns = append(p.conns, c)
		p.accepted++
		p.mu.Unlock()
		p.wg.Add(2)
		go c.pipe(&p.wg, up, down)
		go c.pipe(&p.wg, down, up)
	}
}

// pipe copies src to dst, reading only while not frozen.
func (c *frozenPair) pipe(wg *sync.WaitGroup, dst, src net.Conn) {
	defer wg.Done()
	defer c.close()
	buf := make([]byte, 32<<10)
	for {
		if !c.wait() {
			return
		}
		n, err := src.Read(buf)
		if n > 0 {
			if !c.wait() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// wait blocks while the pair is frozen and reports whether it is still
// open.
func (c *frozenPair) wait() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.frozen && !c.closed {
		c.cond.Wait()
	}
	return !c.closed
}

func (c *frozenPair) close() {
	c.mu.Lock()
	c.closed = true
	c.cond.Broadcast()
	c.mu.Unlock()
	_ = c.down.Close()
	_ = c.up.Close()
}

// Freeze freezes every connection open now.
func (p *freezeProxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.mu.Lock()
		c.frozen = true
		c.mu.Unlock()
	}
}

// Accepted counts the connections the proxy accepted.
func (p *freezeProxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// URL is the proxy's https:// URL.
func (p *freezeProxy) URL() string { return "https://" + p.ln.Addr().String() }

// bigLogs is a logs.collect of 1,000 lines: about 60 KB of output.
func bigLogs(id string) *gatewayv1.SessionResponse {
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Command{Command: &gatewayv1.Command{
		CommandId: id, Kind: fakehw.KindLogsCollect, ArgsJson: []byte(`{"lines":1000}`), RetrySafe: true,
		Deadline: timestamppb.New(clock.New().Now().Add(time.Hour)),
	}}}
}

// TestFrozenGatewayFailover: a machine whose gateway freezes (it stops
// reading and answering, the connection stays open) while the machine has
// megabytes of command results to write — more than the HTTP/2 window and
// the socket buffers hold, so its writes block — drops the session because
// the gateway was silent for the silence timeout, closes the connection
// under it, and holds a session on the other gateway. Nothing else ends
// the frozen session: the proxy never closes it.
func TestFrozenGatewayFailover(t *testing.T) {
	cp := newControlPlane(t, 1)
	gws := map[string]*fakeGateway{"gw-a": cp.gw, "gw-b": newFakeGateway("gw-b")}
	proxies := map[string]*freezeProxy{}
	var urls []string
	for _, id := range []string{"gw-a", "gw-b"} {
		g := gws[id]
		g.id, g.heartbeat = id, 300*time.Millisecond
		u := cp.gwURL
		if id == "gw-b" {
			u = cp.serveGateway(g)
		}
		proxies[id] = newFreezeProxy(t, strings.TrimPrefix(u, "https://"))
		urls = append(urls, proxies[id].URL())
	}
	cfg := cp.config(t.TempDir(), 1)
	cfg.GatewayURL = strings.Join(urls, ",")
	cfg.Core.SilenceTimeout = 3 * time.Second
	d := fakehw.DefaultDurations()
	d.ByKind[fakehw.KindLogsCollect] = time.Second
	r, _ := start(t, cfg, agent.Deps{Logger: testLogger(t), Hardware: fakeHardware("", &d)})
	waitEstablished(t, r)
	m := r.Machines()[0]
	node := m.NodeID()
	first := m.Status().GatewayID
	require.Contains(t, gws, first)
	other := "gw-a"
	if first == "gw-a" {
		other = "gw-b"
	}

	// 60 commands of ~60 KB results each; once all run, freeze the gateway
	// before they finish.
	const n = 60
	cmdIDs := make([]string, n)
	for i := range cmdIDs {
		cmdIDs[i] = ids.New(ids.Command, clock.New().Now())
		gws[first].send(t, node, bigLogs(cmdIDs[i]))
	}
	require.Eventually(t, func() bool {
		for _, id := range cmdIDs {
			if len(gws[first].updates(node, id)) == 0 {
				return false
			}
		}
		return true
	}, waitFor, tick, "every command reported RUNNING")
	proxies[first].Freeze()

	require.Eventually(t, func() bool {
		st := m.Status()
		return st.State == daemon.StateEstablished && st.GatewayID == other
	}, 60*time.Second, 10*time.Millisecond, "the machine holds a session on %s", other)
	require.Equal(t, 1, m.Status().Silenced, "the frozen session ended because its gateway was silent")
	// The results written into the frozen connection are lost with it; the
	// new gateway delivers the open commands again (as the real one does on
	// a new session) and the daemon answers from its journal: each ran once.
	for _, id := range cmdIDs {
		gws[other].send(t, node, bigLogs(id))
	}
	require.Eventually(t, func() bool {
		for _, id := range cmdIDs {
			u := gws[other].updates(node, id)
			if len(u) == 0 || u[len(u)-1].GetState() != gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED {
				return false
			}
		}
		return true
	}, 30*time.Second, 10*time.Millisecond, "the results reach %s", other)
	st := m.Status()
	require.Equal(t, n, st.Runs, "each command ran once")
	require.Equal(t, 1, st.Silenced)
	require.Equal(t, other, st.GatewayID)
}

// TestFrozenConnectionIsReplaced: with a single gateway whose connection
// freezes while new connections still go through (a middlebox that lost
// the connection's state), the machine drops the silent session and holds
// a new one over a new connection, instead of opening the next stream on
// the frozen connection.
func TestFrozenConnectionIsReplaced(t *testing.T) {
	cp := newControlPlane(t, 1)
	cp.gw.heartbeat = 300 * time.Millisecond
	proxy := newFreezeProxy(t, strings.TrimPrefix(cp.gwURL, "https://"))
	cfg := cp.config(t.TempDir(), 1)
	cfg.GatewayURL = proxy.URL()
	cfg.Core.SilenceTimeout = 3 * time.Second
	r, _ := start(t, cfg, agent.Deps{Logger: testLogger(t)})
	waitEstablished(t, r)
	m := r.Machines()[0]
	session := m.Status().SessionID
	require.Equal(t, 1, proxy.Accepted())

	proxy.Freeze()
	require.Eventually(t, func() bool {
		st := m.Status()
		return st.State == daemon.StateEstablished && st.SessionID != session
	}, 60*time.Second, 10*time.Millisecond, "the machine holds a new session")
	require.Equal(t, 1, m.Status().Silenced, "the frozen session ended because its gateway was silent")
	require.Equal(t, 2, proxy.Accepted(), "the new session came over a new connection")
	require.Len(t, cp.gw.helloes(m.NodeID()), 2, fmt.Sprintf("hellos: %v", cp.gw.helloes(m.NodeID())))
}
