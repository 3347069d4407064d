// Package lb is the small TCP load balancer that compose puts in front of a
// scaled service (`better-compute lb`): it accepts connections on one
// address and splices each, byte for byte, to one of the addresses a host
// name resolves to (docker's DNS gives a compose service's name the address
// of each of its replicas), round robin. Working on TCP and not on HTTP, it
// carries whatever the service speaks unchanged: HTTP/1.1, h2c (Connect
// streams), NDJSON watches, WebSocket tunnels; each connection stays on one
// replica for its life, and a client that opens a new one (the CLI does per
// command) may land on another.
//
// It resolves the name every Interval, so replicas that start or go away
// are picked up, and skips an address that refuses a connection (a replica
// killed before DNS forgets it) for the next one.
package lb

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
)

// Defaults of Balancer's fields.
const (
	DefaultInterval    = 2 * time.Second
	DefaultDialTimeout = 2 * time.Second
)

// Balancer spreads the connections of a listener over Backend's addresses.
type Balancer struct {
	// Backend is host:port; host is resolved every Interval (an IP is used
	// as it is).
	Backend string
	// Interval is how often Backend's host is resolved again;
	// DefaultInterval if zero.
	Interval time.Duration
	// DialTimeout bounds the dial of one backend address, after which the
	// next is tried; DefaultDialTimeout if zero.
	DialTimeout time.Duration
	// LookupHost resolves Backend's host to IP addresses;
	// net.DefaultResolver.LookupHost if nil.
	LookupHost func(ctx context.Context, host string) ([]string, error)
	// Clock paces the resolution; the real clock if nil.
	Clock clock.Clock
	// Logger receives changes of the address set and dial failures;
	// discarded if nil.
	Logger *slog.Logger

	mu    sync.Mutex
	addrs []string
	next  atomic.Uint64
}

func (b *Balancer) logger() *slog.Logger {
	if b.Logger != nil {
		return b.Logger
	}
	return slog.New(slog.DiscardHandler)
}

func (b *Balancer) lookupHost(ctx context.Context, host string) ([]string, error) {
	if b.LookupHost != nil {
		return b.LookupHost(ctx, host)
	}
	return net.DefaultResolver.LookupHost(ctx, host)
}

// Addrs returns the backend addresses (ip:port) of the latest resolution,
// sorted.
func (b *Balancer) Addrs() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.addrs)
}

// Resolve resolves Backend's host now and keeps the addresses when there
// are any (a failed lookup keeps the previous set: DNS hiccups do not empty
// the pool). It returns the lookup's error.
func (b *Balancer) Resolve(ctx context.Context) error {
	host, port, err := net.SplitHostPort(b.Backend)
	if err != nil {
		return fmt.Errorf("backend %q: %w", b.Backend, err)
	}
	var ips []string
	if net.ParseIP(host) != nil {
		ips = []string{host}
	} else {
		ips, err = b.lookupHost(ctx, host)
		if err != nil {
			return fmt.Errorf("resolve %s: %w", host, err)
		}
	}
	addrs := make([]string, 0, len(ips))
	for _, ip := range ips {
		addrs = append(addrs, net.JoinHostPort(ip, port))
	}
	slices.Sort(addrs)
	addrs = slices.Compact(addrs)
	b.mu.Lock()
	changed := !slices.Equal(addrs, b.addrs)
	if len(addrs) > 0 {
		b.addrs = addrs
	}
	b.mu.Unlock()
	if changed {
		b.logger().Info("backend addresses", "backend", b.Backend, "addrs", addrs)
	}
	return nil
}

// Serve resolves Backend, then accepts connections on ln until ctx ends
// (it closes ln then) and splices each to a backend address. It returns
// nil when ctx ended, else the accept error.
func (b *Balancer) Serve(ctx context.Context, ln net.Listener) error {
	if err := b.Resolve(ctx); err != nil {
		b.logger().Warn("resolve backend", "error", err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Go(func() { b.resolveLoop(ctx) })
	wg.Go(func() {
		<-ctx.Done()
		_ = ln.Close()
	})
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		wg.Go(func() { b.handle(ctx, conn) })
	}
}

func (b *Balancer) resolveLoop(ctx context.Context) {
	c := b.Clock
	if c == nil {
		c = clock.New()
	}
	interval := b.Interval
	if interval <= 0 {
		interval = DefaultInterval
	}
	t := c.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			if err := b.Resolve(ctx); err != nil && ctx.Err() == nil {
				b.logger().Warn("resolve backend", "error", err)
			}
		}
	}
}

// Dial connects to a backend address, starting at the next one in round
// robin and trying each in turn until one accepts; with none resolved yet,
// it resolves first.
func (b *Balancer) Dial(ctx context.Context) (net.Conn, error) {
	addrs := b.Addrs()
	if len(addrs) == 0 {
		if err := b.Resolve(ctx); err != nil {
			return nil, err
		}
		if addrs = b.Addrs(); len(addrs) == 0 {
			return nil, fmt.Errorf("backend %s: no address", b.Backend)
		}
	}
	timeout := b.DialTimeout
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	start := b.next.Add(1)
	var errs []error
	for i := range addrs {
		addr := addrs[(start+uint64(i))%uint64(len(addrs))]
		d := net.Dialer{Timeout: timeout}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			return conn, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("backend %s: %w", b.Backend, errors.Join(errs...))
}

// handle splices conn to a backend until both directions end or ctx does.
func (b *Balancer) handle(ctx context.Context, conn net.Conn) {
	defer conn.Close()
	up, err := b.Dial(ctx)
	if err != nil {
		b.logger().Warn("no backend for a connection", "remote", conn.RemoteAddr().String(), "error", err)
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		// Half-close: the other direction may still carry an answer.
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			_ = dst.Close()
		}
		done <- struct{}{}
	}
	go pipe(up, conn)
	go pipe(conn, up)
	for n := 0; n < 2; {
		select {
		case <-done:
			n++
		case <-ctx.Done():
			_ = conn.Close()
			_ = up.Close()
			for ; n < 2; n++ {
				<-done
			}
		}
	}
}

// HealthHandler serves /healthz (200 while it runs) and /readyz (200 when
// at least one backend address is known, else 503).
func (b *Balancer) HealthHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if len(b.Addrs()) == 0 {
			http.Error(w, "no backend address", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	return mux
}
