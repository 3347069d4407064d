package agent

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// newTransport returns an HTTP/2-only transport for one machine, whose
// connections conns tracks. A gateway that acknowledges heartbeats and
// stops answering is noticed by the daemon core (daemon.Config
// SilenceTimeout, 15 s), which has the driver close the connection. Below
// that, the transport notices a connection that died silently within 25 s:
// on Linux by the heartbeats it cannot deliver (TCP_USER_TIMEOUT,
// transport_linux.go), elsewhere by an HTTP/2 ping after 15 s without a
// frame; those are what notice a hung gateway that does not acknowledge
// heartbeats (an older one), the ping within 70 s.
func newTransport(tlsCfg *tls.Config, conns *connTracker) *http.Transport {
	var p http.Protocols
	p.SetHTTP2(true)
	return &http.Transport{
		Protocols:           &p,
		TLSClientConfig:     tlsCfg,
		DialContext:         newDialer(conns),
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConns:        1,
		IdleConnTimeout:     90 * time.Second,
		HTTP2: &http.HTTP2Config{
			SendPingTimeout: pingIdle,
			PingTimeout:     10 * time.Second,
		},
	}
}

// newDialer dials the gateways for one machine: connections its tracker
// conns keeps, with the socket options of dialControl.
func newDialer(conns *connTracker) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return conns.wrap((&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second, Control: dialControl}).DialContext)
}

// connTracker keeps the connections a machine's transports dialed, by
// address, so that the driver can close the connections to a gateway that
// stopped answering (daemon.EffectClose with Abort). Cancelling a stream is
// not enough there: the HTTP/2 connection stays in the transport's pool,
// the next session to that gateway would queue on it, and a write blocked
// on its full send buffer would only return when the kernel gives up.
// Closing the TCP connection under TLS and HTTP/2 ends all of that at once.
// Safe for concurrent use.
type connTracker struct {
	mu    sync.Mutex
	conns map[*trackedConn]struct{}
}

func newConnTracker() *connTracker {
	return &connTracker{conns: map[*trackedConn]struct{}{}}
}

// wrap returns dial, recording each connection it opens.
func (t *connTracker) wrap(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		tc := &trackedConn{Conn: c, addr: addr, t: t}
		t.mu.Lock()
		t.conns[tc] = struct{}{}
		t.mu.Unlock()
		return tc, nil
	}
}

// closeAddr closes every tracked connection to addr ("host:port") and
// returns how many it closed.
func (t *connTracker) closeAddr(addr string) int {
	t.mu.Lock()
	var victims []*trackedConn
	for c := range t.conns {
		if c.addr == addr {
			victims = append(victims, c)
		}
	}
	t.mu.Unlock()
	for _, c := range victims {
		_ = c.Close()
	}
	return len(victims)
}

// trackedConn is a dialed connection that leaves its tracker when closed.
type trackedConn struct {
	net.Conn
	addr string
	t    *connTracker
}

// Close closes the connection and forgets it.
func (c *trackedConn) Close() error {
	c.t.mu.Lock()
	delete(c.t.conns, c)
	c.t.mu.Unlock()
	return c.Conn.Close()
}

// dialAddr returns the address the transport dials for an https:// gateway
// URL: its host and port, 443 when the URL names none.
func dialAddr(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return ""
	}
	port := u.Port()
	if port == "" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port)
}
