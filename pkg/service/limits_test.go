package service_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/service/servicetest"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// waitFor is how long a test waits for something that should happen
// promptly.
const waitFor = 15 * time.Second

var realClock = clock.New()

// runServer runs a service whose one server serves h with limits (and the
// probes) until the test ends, and returns its address.
func runServer(t *testing.T, h http.Handler, limits service.HTTPLimits, tlsConfig *tls.Config, deps service.Deps) string {
	t.Helper()
	ln := listen(t)
	spec := service.Spec{Name: "test", Deps: deps, Servers: []service.HTTPServer{{
		Name: "main", Listener: ln, Handler: h, Probes: true, Limits: limits, TLS: tlsConfig}}}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	errc := make(chan error, 1)
	go func() { errc <- service.Run(ctx, spec) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-errc)
	})
	return ln.Addr().String()
}

// TestNewServerLimits checks the limits NewServer gives a server: the
// defaults of HTTPLimits for zero fields, the given ones otherwise, and no
// whole-request ReadTimeout or WriteTimeout, which would cut long-lived
// streams.
func TestNewServerLimits(t *testing.T) {
	t.Parallel()
	srv := service.NewServer(":0", http.NotFoundHandler(), service.HTTPLimits{})
	require.Equal(t, 10*time.Second, srv.ReadHeaderTimeout)
	require.Equal(t, 2*time.Minute, srv.IdleTimeout)
	require.Equal(t, 100, srv.HTTP2.MaxConcurrentStreams)
	require.Zero(t, srv.ReadTimeout)
	require.Zero(t, srv.WriteTimeout)
	require.Equal(t, 64<<10, srv.MaxHeaderBytes)

	srv = service.NewServer(":0", http.NotFoundHandler(), service.HTTPLimits{HTTPReadHeaderTimeout: time.Second,
		HTTPIdleTimeout: time.Minute, HTTPMaxStreams: 7})
	require.Equal(t, time.Second, srv.ReadHeaderTimeout)
	require.Equal(t, time.Minute, srv.IdleTimeout)
	require.Equal(t, 7, srv.HTTP2.MaxConcurrentStreams)
}

// TestConnectionCap checks that a server holds at most HTTPMaxConnections
// connections: one more waits, unanswered, until one closes.
func TestConnectionCap(t *testing.T) {
	t.Parallel()
	addr := runServer(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("hi")) }),
		service.HTTPLimits{HTTPMaxConnections: 1}, nil, service.Deps{})

	// The first connection is answered and stays open (keep-alive).
	first, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer first.Close()
	_, err = io.WriteString(first, "GET /x HTTP/1.1\r\nHost: test\r\n\r\n")
	require.NoError(t, err)
	res, err := http.ReadResponse(bufio.NewReader(first), nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.NoError(t, res.Body.Close())

	second := make(chan error, 1)
	go func() {
		c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
		res, err := c.Get("http://" + addr + "/x")
		if err == nil {
			err = res.Body.Close()
			if res.StatusCode != http.StatusOK {
				err = errors.New(res.Status)
			}
		}
		second <- err
	}()
	timer := realClock.NewTimer(300 * time.Millisecond)
	defer timer.Stop()
	select {
	case err := <-second:
		require.FailNow(t, "a connection beyond the cap was answered", "%v", err)
	case <-timer.C():
	}
	require.NoError(t, first.Close())
	select {
	case err := <-second:
		require.NoError(t, err, "answered once the first connection closed")
	case <-after(waitFor):
		require.FailNow(t, "the waiting connection was not answered after the first one closed")
	}
}

// TestMaxStreams checks that a server announces HTTPMaxStreams as its
// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS.
func TestMaxStreams(t *testing.T) {
	t.Parallel()
	addr := runServer(t, http.NotFoundHandler(), service.HTTPLimits{HTTPMaxStreams: 7}, nil, service.Deps{})
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(realClock.Now().Add(waitFor)))
	_, err = io.WriteString(conn, http2.ClientPreface)
	require.NoError(t, err)
	fr := http2.NewFramer(conn, conn)
	require.NoError(t, fr.WriteSettings())
	for {
		f, err := fr.ReadFrame()
		require.NoError(t, err)
		if s, ok := f.(*http2.SettingsFrame); ok && !s.IsAck() {
			v, ok := s.Value(http2.SettingMaxConcurrentStreams)
			require.True(t, ok, "the server announces its stream limit")
			require.Equal(t, uint32(7), v)
			return
		}
	}
}

// TestRequestTimeout checks, over HTTP/1.1 and h2c, that HTTPRequestTimeout
// bounds reading a request's body and writing its response, that a
// handler that declares its request long-lived (service.LongLived) reads
// and writes for longer, and that service.BoundWrite bounds one write of
// such a stream.
func TestRequestTimeout(t *testing.T) {
	t.Parallel()
	const timeout = 200 * time.Millisecond
	errs := make(chan error, 16)
	mux := http.NewServeMux()
	read := func(w http.ResponseWriter, r *http.Request) {
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			errs <- err
			return
		}
		_, _ = io.WriteString(w, strings.Repeat("r", int(n)))
	}
	write := func(w http.ResponseWriter, _ *http.Request) {
		chunk := make([]byte, 64<<10)
		for {
			if _, err := w.Write(chunk); err != nil {
				errs <- err
				return
			}
		}
	}
	mux.HandleFunc("/read", read)
	mux.HandleFunc("/write", write)
	mux.HandleFunc("/stream/read", func(w http.ResponseWriter, r *http.Request) {
		service.LongLived(r.Context())
		read(w, r)
	})
	// A watch: a line every half timeout, each write bounded.
	mux.HandleFunc("/stream/lines", func(w http.ResponseWriter, r *http.Request) {
		service.LongLived(r.Context())
		for range 10 {
			<-after(timeout / 2)
			done := service.BoundWrite(r.Context())
			_, err := io.WriteString(w, "line\n")
			if err == nil {
				err = http.NewResponseController(w).Flush()
			}
			done()
			if err != nil {
				errs <- err
				return
			}
		}
	})
	// A watch whose client does not read: a bounded write fails.
	mux.HandleFunc("/stream/write", func(w http.ResponseWriter, r *http.Request) {
		service.LongLived(r.Context())
		chunk := make([]byte, 64<<10)
		for {
			done := service.BoundWrite(r.Context())
			_, err := w.Write(chunk)
			if err == nil {
				err = http.NewResponseController(w).Flush()
			}
			done()
			if err != nil {
				errs <- err
				return
			}
		}
	})
	addr := runServer(t, mux, service.HTTPLimits{HTTPRequestTimeout: timeout}, nil, service.Deps{})

	for _, proto := range []string{"HTTP/1.1", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			var p http.Protocols
			if proto == "h2c" {
				p.SetUnencryptedHTTP2(true)
			} else {
				p.SetHTTP1(true)
			}
			tr := &http.Transport{Protocols: &p}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr}
			url := "http://" + addr

			// A body that stalls after its first byte: the read fails.
			body, stall := io.Pipe()
			defer stall.Close()
			go func() { _, _ = stall.Write([]byte("x")) }()
			go func() {
				if res, err := c.Post(url+"/read", "text/plain", body); err == nil {
					_ = res.Body.Close()
				}
			}()
			requireTimeout(t, errs, "a stalled body")

			// A response the client does not read: the write fails.
			res, err := c.Get(url + "/write")
			require.NoError(t, err)
			requireTimeout(t, errs, "an unread response")
			_ = res.Body.Close()

			// A long-lived stream whose client does not read: its
			// bounded write fails.
			res, err = c.Get(url + "/stream/write")
			require.NoError(t, err)
			requireTimeout(t, errs, "an unread stream")
			_ = res.Body.Close()

			// A long-lived stream writes for 5 timeouts.
			res, err = c.Get(url + "/stream/lines")
			require.NoError(t, err)
			got, err := io.ReadAll(res.Body)
			require.NoError(t, err)
			require.NoError(t, res.Body.Close())
			require.Equal(t, strings.Repeat("line\n", 10), string(got))

			// A long-lived stream reads a body that takes 5 timeouts.
			slow, feed := io.Pipe()
			go func() {
				defer feed.Close()
				for range 10 {
					<-after(timeout / 2)
					if _, err := feed.Write([]byte("x")); err != nil {
						return
					}
				}
			}()
			res, err = c.Post(url+"/stream/read", "text/plain", slow)
			require.NoError(t, err)
			got, err = io.ReadAll(res.Body)
			require.NoError(t, err)
			require.NoError(t, res.Body.Close())
			require.Equal(t, strings.Repeat("r", 10), string(got))
			select {
			case err := <-errs:
				require.FailNow(t, "a long-lived stream failed", "%v", err)
			default:
			}
		})
	}
}

// requireTimeout waits for a handler's error, a deadline's.
func requireTimeout(t *testing.T, errs <-chan error, what string) {
	t.Helper()
	select {
	case err := <-errs:
		require.Error(t, err, what)
	case <-after(waitFor):
		require.FailNow(t, what+" was not cut by the request timeout")
	}
}

// TestReadyzHidesDatabaseError checks that GET /readyz says that the
// database is unreachable without the database's error, which is logged.
func TestReadyzHidesDatabaseError(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(t.Context(), "postgres://bc:secret@127.0.0.1:1/bc?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var logs syncBuffer
	addr := runServer(t, http.NotFoundHandler(), service.HTTPLimits{}, nil,
		service.Deps{DB: &store.DB{Pool: pool}, Logger: telemetry.NewLogger(&logs, "test")})
	code, body := get(t, "http://"+addr+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "unhealthy: database unreachable\n", body)
	require.Contains(t, logs.String(), "127.0.0.1", "the real error is logged")
}

// TestServeTLS checks that a server with the TLS setting serves HTTPS,
// HTTP/2 by ALPN and HTTP/1.1, its probes included, and nothing in clear.
func TestServeTLS(t *testing.T) {
	t.Parallel()
	setting, roots := servicetest.ServingCert(t, "", "localhost")
	cfg, err := setting.ServerConfig()
	require.NoError(t, err)
	addr := runServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, r.Proto) }),
		service.HTTPLimits{}, cfg, service.Deps{})
	_, port, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	url := "https://localhost:" + port
	for _, proto := range []string{"HTTP/2.0", "HTTP/1.1"} {
		var p http.Protocols
		if proto == "HTTP/2.0" {
			p.SetHTTP2(true)
		} else {
			p.SetHTTP1(true)
		}
		tr := &http.Transport{Protocols: &p, TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
		c := &http.Client{Transport: tr}
		res, err := c.Get(url + "/x")
		require.NoError(t, err)
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		require.NoError(t, res.Body.Close())
		require.Equal(t, proto, string(b))
		res, err = c.Get(url + "/healthz")
		require.NoError(t, err)
		require.NoError(t, res.Body.Close())
		require.Equal(t, http.StatusOK, res.StatusCode)
		tr.CloseIdleConnections()
	}
	res, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Get("http://" + addr + "/healthz")
	if err == nil {
		require.NoError(t, res.Body.Close())
		require.Equal(t, http.StatusBadRequest, res.StatusCode, "plain HTTP is refused")
	}
}

// TestTLSSetting checks the TLS setting's refusals: one file without the
// other, names the missing variable; a pair that does not load names
// TLS_CERT. Neither is no TLS.
func TestTLSSetting(t *testing.T) {
	t.Parallel()
	good, _ := servicetest.ServingCert(t, "", "localhost")
	for _, c := range []struct {
		name    string
		setting service.TLS
		// variable is the one the error names; "" for no error.
		variable string
	}{
		{name: "neither", setting: service.TLS{}},
		{name: "both", setting: good},
		{name: "cert alone", setting: service.TLS{TLSCert: good.TLSCert}, variable: "BETTER_COMPUTE_TLS_KEY"},
		{name: "key alone", setting: service.TLS{TLSKey: good.TLSKey}, variable: "BETTER_COMPUTE_TLS_CERT"},
		{name: "missing files", setting: service.TLS{TLSCert: good.TLSCert + ".missing", TLSKey: good.TLSKey},
			variable: "BETTER_COMPUTE_TLS_CERT"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := c.setting.ServerConfig()
			if c.variable == "" {
				require.NoError(t, err)
				require.Equal(t, c.setting.TLSCert != "", cfg != nil)
				return
			}
			var cerr *config.Error
			require.ErrorAs(t, err, &cerr)
			require.Equal(t, c.variable, cerr.Name)
			require.Nil(t, cfg)
		})
	}
}

// after is time.After on the real clock.
func after(d time.Duration) <-chan time.Time { return realClock.NewTimer(d).C() }
