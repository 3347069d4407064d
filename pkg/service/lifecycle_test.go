package service_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// journal records what the parts of a test service did, in order.
type journal struct {
	mu     sync.Mutex
	events []string
}

func (j *journal) add(e string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.events = append(j.events, e)
}

func (j *journal) get() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]string(nil), j.events...)
}

// part is a Runner and Starter that records its start, run and stop, and
// fails its Start or Run when told.
type part struct {
	name      string
	j         *journal
	startErr  error
	runErr    error
	running   chan struct{}
	onceReady sync.Once
}

func newPart(name string, j *journal) *part {
	return &part{name: name, j: j, running: make(chan struct{})}
}

func (p *part) Name() string { return p.name }

func (p *part) Start(context.Context) error {
	p.j.add("start " + p.name)
	return p.startErr
}

func (p *part) Run(ctx context.Context) error {
	p.j.add("run " + p.name)
	p.onceReady.Do(func() { close(p.running) })
	if p.runErr != nil {
		return p.runErr
	}
	<-ctx.Done()
	p.j.add("stop " + p.name)
	return nil
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return ln
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestRunOrder: servers listen first, parts start in order, and at the end
// the servers stop before the parts, each in the reverse of its order; the
// probes answer on the server that asks for them, beside its handler.
func TestRunOrder(t *testing.T) {
	t.Parallel()
	j := &journal{}
	a, b := newPart("a", j), newPart("b", j)
	ln := listen(t)
	var ready error
	var readyMu sync.Mutex
	spec := service.Spec{
		Name:  "test",
		Parts: []service.Runner{a, b},
		Servers: []service.HTTPServer{{
			Name: "main", Listener: ln, Probes: true,
			Handler:    http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("hello")) }),
			OnShutdown: func() { j.add("shutdown main") },
		}},
		Ready: []service.Check{func(context.Context) error {
			readyMu.Lock()
			defer readyMu.Unlock()
			return ready
		}},
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- service.Run(ctx, spec) }()
	<-a.running
	<-b.running
	base := "http://" + ln.Addr().String()
	require.Eventually(t, func() bool {
		c, _ := get(t, base+"/healthz")
		return c == http.StatusOK
	}, 10*time.Second, 10*time.Millisecond)
	code, body := get(t, base+"/readyz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok\n", body)
	readyMu.Lock()
	ready = errors.New("database down")
	readyMu.Unlock()
	code, body = get(t, base+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "unhealthy: database down\n", body)
	code, _ = get(t, base+"/healthz")
	require.Equal(t, http.StatusOK, code, "alive while a dependency is down")
	code, body = get(t, base+"/other")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "hello", body)

	cancel()
	require.NoError(t, <-errc)
	ev := j.get()
	require.Equal(t, []string{"start a", "start b"}, ev[:2])
	require.Equal(t, []string{"shutdown main", "stop b", "stop a"}, ev[len(ev)-3:])
	_, err := net.Dial("tcp", ln.Addr().String())
	require.Error(t, err, "the listener is closed")
}

// TestRunPartFails: a part that fails stops the others and its error, named,
// is Run's.
func TestRunPartFails(t *testing.T) {
	t.Parallel()
	j := &journal{}
	a, b := newPart("a", j), newPart("b", j)
	b.runErr = errors.New("boom")
	err := service.Run(t.Context(), service.Spec{Name: "test", Parts: []service.Runner{a, b}})
	require.EqualError(t, err, "b: boom")
	require.Contains(t, j.get(), "stop a")
}

// TestRunStartFails: a failed Start runs nothing new; the parts that started
// are run with an ended context, so that they release what they took, and
// the servers' listeners are closed.
func TestRunStartFails(t *testing.T) {
	t.Parallel()
	j := &journal{}
	a, b, c := newPart("a", j), newPart("b", j), newPart("c", j)
	b.startErr = errors.New("no")
	ln := listen(t)
	err := service.Run(t.Context(), service.Spec{Name: "test", Parts: []service.Runner{a, b, c},
		Servers: []service.HTTPServer{{Name: "probes", Listener: ln, Probes: true}}})
	require.EqualError(t, err, "b: no")
	require.ElementsMatch(t, []string{"start a", "start b", "run a", "stop a"}, j.get())
	_, err = net.Dial("tcp", ln.Addr().String())
	require.Error(t, err, "the listener is closed")
}

// TestRunBusyPort: a server whose port is taken fails the service before
// any part starts.
func TestRunBusyPort(t *testing.T) {
	t.Parallel()
	j := &journal{}
	ln := listen(t)
	defer ln.Close()
	err := service.Run(t.Context(), service.Spec{Name: "test", Parts: []service.Runner{newPart("a", j)},
		Servers: []service.HTTPServer{{Name: "health", Addr: ln.Addr().String(), Probes: true}}})
	require.ErrorContains(t, err, "health server: listen "+ln.Addr().String())
	require.Empty(t, j.get())
}

// TestOnStop: the function runs once the context ended.
func TestOnStop(t *testing.T) {
	t.Parallel()
	var called bool
	r := service.OnStop("closer", func() { called = true })
	require.Equal(t, "closer", r.Name())
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.NoError(t, r.Run(ctx))
	require.True(t, called)
}

// TestProbeURL turns listen addresses into loopback /readyz URLs.
func TestProbeURL(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, listen, want string }{
		{"any address", ":8083", "http://127.0.0.1:8083/readyz"},
		{"IPv4 unspecified", "0.0.0.0:1", "http://127.0.0.1:1/readyz"},
		{"IPv6 unspecified", "[::]:8082", "http://127.0.0.1:8082/readyz"},
		{"an address", "10.0.0.1:8084", "http://10.0.0.1:8084/readyz"},
		{"not an address", "not an address", "http://127.0.0.1/readyz"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, c.want, service.ProbeURL(c.listen))
		})
	}
}

// TestProbesServeMetrics: with Deps.Metrics of the prometheus exporter, the
// probes server answers GET /metrics with what the service recorded, beside
// /healthz; with the none exporter, or none at all, /metrics is the
// server's Handler's (here: none, 404).
func TestProbesServeMetrics(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		exporter telemetry.Exporter
		want     int
	}{
		{"prometheus", telemetry.ExporterPrometheus, http.StatusOK},
		{"none", telemetry.ExporterNone, http.StatusNotFound},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			m, err := telemetry.NewMetrics(t.Context(), c.exporter, "test")
			require.NoError(t, err)
			telemetry.Int64Counter(m.Meter("test"), telemetry.LivenessSweeps).Add(t.Context(), 7)
			ln := listen(t)
			ctx, cancel := context.WithCancel(t.Context())
			errc := make(chan error, 1)
			go func() {
				errc <- service.Run(ctx, service.Spec{Name: "test", Deps: service.Deps{Metrics: m},
					Servers: []service.HTTPServer{{Name: "health", Listener: ln, Probes: true}}})
			}()
			base := "http://" + ln.Addr().String()
			require.Eventually(t, func() bool {
				code, _ := get(t, base+"/healthz")
				return code == http.StatusOK
			}, 10*time.Second, 10*time.Millisecond)
			code, body := get(t, base+"/metrics")
			require.Equal(t, c.want, code)
			if c.want == http.StatusOK {
				require.Contains(t, body, "\nbc_liveness_sweeps_total{")
				require.Contains(t, body, "} 7\n")
			}
			cancel()
			require.NoError(t, <-errc)
		})
	}
}
