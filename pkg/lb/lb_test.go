package lb_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/lb"
)

// echoServer listens on addr and answers each line with its name and the
// line; the returned func stops it (its address then refuses connections).
func echoServer(t *testing.T, addr, name string) func() {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := fmt.Fprintf(c, "%s %s", name, line); err != nil {
						return
					}
				}
			})
		}
	})
	var once sync.Once
	stop := func() { once.Do(func() { _ = ln.Close() }) }
	t.Cleanup(func() { stop(); wg.Wait() })
	return stop
}

// roundTrip opens a connection through the balancer, sends one line and
// returns the answer.
func roundTrip(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer c.Close()
	_, err = io.WriteString(c, "ping\n")
	require.NoError(t, err)
	line, err := bufio.NewReader(c).ReadString('\n')
	require.NoError(t, err)
	return line
}

// TestBalancer: a name resolving to two replicas (127.0.0.1 and 127.0.0.2,
// one port) gets connections alternately on each; once one refuses
// connections every connection goes to the other; a replica that leaves
// the name's answer is dropped at the next resolution and a failed lookup
// keeps the previous set; with nothing answering, a connection is closed.
func TestBalancer(t *testing.T) {
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := strconv.Itoa(probe.Addr().(*net.TCPAddr).Port)
	require.NoError(t, probe.Close())
	stopA := echoServer(t, "127.0.0.1:"+port, "a")
	stopB := echoServer(t, "127.0.0.2:"+port, "b")

	var answer atomic.Value
	answer.Store([]string{"127.0.0.2", "127.0.0.1"})
	bal := &lb.Balancer{Backend: "replicas:" + port, LookupHost: func(_ context.Context, host string) ([]string, error) {
		if host != "replicas" {
			return nil, fmt.Errorf("no such host %s", host)
		}
		ips := answer.Load().([]string)
		if len(ips) == 0 {
			return nil, fmt.Errorf("lookup %s: server misbehaving", host)
		}
		return ips, nil
	}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- bal.Serve(ctx, ln) }()

	got := map[string]int{}
	for range 4 {
		got[roundTrip(t, ln.Addr().String())]++
	}
	require.Empty(t, cmp.Diff(map[string]int{"a ping\n": 2, "b ping\n": 2}, got), "round robin over both replicas")
	require.Empty(t, cmp.Diff([]string{"127.0.0.1:" + port, "127.0.0.2:" + port}, bal.Addrs()))

	srv := httptest.NewServer(bal.HealthHandler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/readyz")
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)

	// A killed replica still in DNS refuses: the next one is tried.
	stopA()
	for range 3 {
		require.Equal(t, "b ping\n", roundTrip(t, ln.Addr().String()))
	}

	// A failed lookup keeps the set; a new answer replaces it.
	answer.Store([]string{})
	require.Error(t, bal.Resolve(t.Context()))
	require.Len(t, bal.Addrs(), 2)
	answer.Store([]string{"127.0.0.2"})
	require.NoError(t, bal.Resolve(t.Context()))
	require.Empty(t, cmp.Diff([]string{"127.0.0.2:" + port}, bal.Addrs()))

	// Nothing answers: the client's connection is closed.
	stopB()
	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, c.Close())

	cancel()
	require.NoError(t, <-served)
}
