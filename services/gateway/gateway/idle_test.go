package gateway_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
)

// Idle framed sessions: where the session's goroutine waits, and that it
// misses nothing that arrived while it was not waiting.

// idleSessionStacks are the stacks of the goroutines serving framed
// sessions (gateway.(*Server).serveFramed) that are parked waiting for
// their connection ("IO wait").
func idleSessionStacks() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var idle []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "gateway.(*Server).serveFramed") && strings.Contains(g, "[IO wait") {
			idle = append(idle, g)
		}
	}
	return idle
}

// TestIdleFramedSessionWaitsOutsideTLS: an idle framed session's goroutine
// waits for the daemon's next bytes on the TCP connection, at a shallow
// frame (idleConn.wait), not inside crypto/tls's Read, so that the
// runtime can shrink its stack to 4 KiB (BenchmarkIdleSessionMemory). Not
// parallel: it reads every goroutine's stack, and other tests' sessions
// would be among them.
func TestIdleFramedSessionWaitsOutsideTLS(t *testing.T) {
	e := setup(t, options{})
	g := e.startGateway(noResync)
	d, _ := e.connect(g, e.newNode(), nil)
	d.heartbeat(1, 0)
	require.EqualValues(t, 1, d.nextAck())
	var stacks []string
	eventually(t, func() bool { stacks = idleSessionStacks(); return len(stacks) == 1 }, "the session's goroutine waits")
	require.Contains(t, stacks[0], "gateway.(*idleConn).wait", "the idle session waits at the shallow frame")
	require.NotContains(t, stacks[0], "crypto/tls.(*Conn).Read", "the idle session waits outside crypto/tls")
}

// heldConn is a daemon's connection whose writes can be held and then
// sent in one write (several TLS records in one TCP segment), or in parts.
type heldConn struct {
	net.Conn
	mu   sync.Mutex
	held *bytes.Buffer // writes held, nil when not holding
}

func (c *heldConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held != nil {
		return c.held.Write(p)
	}
	return c.Conn.Write(p)
}

// hold holds the writes from now on.
func (c *heldConn) hold() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held = new(bytes.Buffer)
}

// send sends the first n bytes held (all for n < 0); when all are sent, it
// stops holding.
func (c *heldConn) send(t *testing.T, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n < 0 || n >= c.held.Len() {
		n = c.held.Len()
	}
	_, err := c.Conn.Write(c.held.Next(n))
	require.NoError(t, err)
	if c.held.Len() == 0 {
		c.held = nil
	}
}

// heldDaemon opens a framed session of a new node through a heldConn and
// waits for its Welcome.
func heldDaemon(t *testing.T) (*daemon, *heldConn) {
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	var hc *heldConn
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		hc = &heldConn{Conn: c}
		return hc, nil
	}
	d, _ := e.welcome(e.openFramed(g, n.cert, dial, &gatewayv1.Hello{NodeId: n.id, BootId: "boot-1", AgentVersion: "test"}))
	return d, hc
}

// TestIdleFramedSessionReadsRecordsThatArrivedTogether: two heartbeats
// whose TLS records arrive in one segment are both answered (crypto/tls
// reads both at once; the session takes the second from it before it
// waits on the connection again).
func TestIdleFramedSessionReadsRecordsThatArrivedTogether(t *testing.T) {
	t.Parallel()
	d, hc := heldDaemon(t)
	hc.hold()
	d.heartbeat(1, 0)
	d.heartbeat(2, 0)
	hc.send(t, -1)
	require.EqualValues(t, 1, d.nextAck())
	require.EqualValues(t, 2, d.nextAck())
}

// TestIdleFramedSessionReadsARecordInParts: a heartbeat whose TLS record
// arrives in parts, the session waiting between them, is answered.
func TestIdleFramedSessionReadsARecordInParts(t *testing.T) {
	t.Parallel()
	d, hc := heldDaemon(t)
	for _, first := range []int{1, 3, 7, 20} {
		hc.hold()
		d.heartbeat(int64(first), 0)
		hc.send(t, first)
		// Give the gateway time to read the first part and wait for the
		// rest (the answer comes either way).
		require.NoError(t, clock.Sleep(t.Context(), realClock, 20*time.Millisecond))
		hc.send(t, -1)
		require.EqualValues(t, first, d.nextAck())
	}
}

// ticketCache is a client session cache that counts the session tickets a
// client was given.
type ticketCache struct {
	tls.ClientSessionCache
	mu   sync.Mutex
	puts int
}

func (c *ticketCache) Put(key string, cs *tls.ClientSessionState) {
	c.mu.Lock()
	c.puts++
	c.mu.Unlock()
	c.ClientSessionCache.Put(key, cs)
}

// TestNoSessionTickets: the gateway issues no TLS session tickets. Daemons
// never resume a session (each dial is a full handshake, its client
// certificate verified), so a ticket would be work and bytes for nothing
// at every join: the state it encrypts holds the client certificate.
func TestNoSessionTickets(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	cache := &ticketCache{ClientSessionCache: tls.NewLRUClientSessionCache(4)}
	ctx, cancel := context.WithCancel(context.Background())
	cfg := &tls.Config{RootCAs: e.servingCAs, Certificates: []tls.Certificate{n.cert}, MinVersion: tls.VersionTLS13,
		ClientSessionCache: cache}
	d, _ := e.welcome(e.start(sessionwire.NewClientStream(ctx, nil, g.addr, cfg, service.MaxMessageBytes), cancel,
		&gatewayv1.Hello{NodeId: n.id, BootId: "boot-1", AgentVersion: "test"}))
	d.heartbeat(1, 0)
	require.EqualValues(t, 1, d.nextAck())
	cache.mu.Lock()
	defer cache.mu.Unlock()
	require.Zero(t, cache.puts, "session tickets the gateway issued")
}
