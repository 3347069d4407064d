// Package service is the one lifecycle of every better-compute service
// (docs/architecture.md, "Services") and what the services share at their
// edge: an HTTP server with sane limits that speaks HTTP/1.1 and h2c,
// Connect handler options (OpenTelemetry, protovalidate, internal-error
// masking), the probes and the `healthcheck` subcommand that scratch images
// use in compose health checks.
//
// Everything long-running implements Runner: Name and Run(ctx), which
// works until ctx ends and then releases what it holds. A service is a
// Runner whose Run hands its Spec (its parts, its HTTP servers, its
// dependencies) to this package's Run, which listens, starts the parts and
// servers in an errgroup, serves GET /healthz and GET /readyz, and stops
// them in order within ShutdownTimeout. A binary's main is Main(name, New):
// configuration (pkg/config, with the shared settings of config.go),
// signals, telemetry, the database and NATS, then the service's Run;
// pkg/devstack runs the same services' Run in one process.
//
// To add a service: a package with a Config (embedding the shared settings
// it reads; ProbeAddr), New(Config, Deps) and Name and Run, and a main.go
// that calls Main. To add a long-running part to a service, add a Runner to
// its Spec's Parts (a reconciler of the controllers: one entry in their
// list, behind its own lease).
package service

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/otelconnect"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// NewServer returns an http.Server for h on addr with the limits l (a zero
// field is its default; HTTPLimits): it accepts HTTP/1.1 and HTTP/2, over
// TLS by ALPN when served with a TLSConfig and cleartext (h2c) otherwise,
// with 64 KiB of headers at most, l's header and idle timeouts and l's
// HTTP/2 streams per connection, and every request is bounded by
// l.HTTPRequestTimeout unless its handler declares it long-lived
// (LongLived); a Connect unary call refused for its message size answers
// 413 (ContentTooLarge). It has no ReadTimeout or WriteTimeout, which would cut
// long-lived streams. Connections are capped by the listener (Run wraps it
// in netutil.LimitListener of l.HTTPMaxConnections).
func NewServer(addr string, h http.Handler, l HTTPLimits) *http.Server {
	l = l.withDefaults()
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Server{
		Addr:              addr,
		Handler:           ContentTooLarge(requestDeadlines(h, l.HTTPRequestTimeout)),
		Protocols:         &p,
		ReadHeaderTimeout: l.HTTPReadHeaderTimeout,
		MaxHeaderBytes:    64 << 10,
		IdleTimeout:       l.HTTPIdleTimeout,
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: l.HTTPMaxStreams},
	}
}

// Serve runs srv on ln (or listens on srv.Addr when ln is nil) until ctx ends,
// then shuts it down, waiting up to 10 s for requests in flight.
func Serve(ctx context.Context, logger *slog.Logger, srv *http.Server, ln net.Listener) error {
	if ln == nil {
		var err error
		ln, err = net.Listen("tcp", srv.Addr)
		if err != nil {
			return fmt.Errorf("listen %s: %w", srv.Addr, err)
		}
	}
	logger.Info("listening", "addr", ln.Addr().String())
	errc := make(chan error, 1)
	go func() {
		var err error
		if srv.TLSConfig != nil {
			err = srv.ServeTLS(ln, "", "")
		} else {
			err = srv.Serve(ln)
		}
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		errc <- err
	}()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	return <-errc
}

// HandlerOptions returns the Connect options of every service: OpenTelemetry
// tracing and the duration histogram of every call (otelconnect, on the
// global providers), masking of Internal/Unknown error details in unary
// and streaming calls (PublicError: database connection failures become
// Unavailable, the rest Internal "internal error"; the real error is logged),
// protovalidate checks of requests (Validation: InvalidArgument
// "<field>: <reason>") and the message limits of MessageOptions
// (MaxMessageBytes). It is
// HandlerOptionsAround with no interceptors of its own.
func HandlerOptions(logger *slog.Logger) []connect.HandlerOption {
	return HandlerOptionsAround(logger, nil, nil, nil)
}

// HandlerOptionsAround is HandlerOptions with the calls' histogram
// (rpc.server.call.duration, docs/metrics.md) recorded through metrics (nil:
// the global MeterProvider) and a service's interceptors placed among the
// shared ones, outermost first: tracing, outer (e.g.
// auditing, which then sees every outcome with messages masked), masking,
// inner (e.g. authentication, so that an unauthenticated caller learns
// nothing from validation and a database error while authenticating is
// masked), validation, the handler.
//
// The server spans are children of the caller's trace context (the
// traceparent header) rather than new traces linked to it, so that one
// trace crosses from the CLI to the machines (docs/architecture.md,
// "Traces"): a trace id grants nothing, and a caller that picks one only
// groups its own calls' spans.
func HandlerOptionsAround(logger *slog.Logger, metrics *telemetry.Metrics, outer, inner []connect.Interceptor) []connect.HandlerOption {
	return HandlerOptionsChecked(logger, metrics, nil, outer, inner)
}

// HandlerOptionsChecked is HandlerOptionsAround whose validation passes the
// requests that checks pass without protovalidate (ValidationWith).
func HandlerOptionsChecked(logger *slog.Logger, metrics *telemetry.Metrics, checks RuleChecks,
	outer, inner []connect.Interceptor,
) []connect.HandlerOption {
	otel, err := otelconnect.NewInterceptor(otelconnect.WithMeterProvider(metrics.MeterProvider()),
		otelconnect.WithTrustRemote())
	if err != nil {
		panic(err) // only fails on invalid options, which are constant here
	}
	ints := []connect.Interceptor{otel}
	ints = append(ints, outer...)
	ints = append(ints, maskInternal(logger))
	ints = append(ints, inner...)
	ints = append(ints, ValidationWith(checks)...)
	return append([]connect.HandlerOption{connect.WithInterceptors(ints...)}, MessageOptions()...)
}

// CompressMinBytes is the size in bytes below which a handler sends a
// message uncompressed even when the peer accepts gzip: compressing the
// small messages of this API (most are under 1 KiB) cost more CPU than it
// saved bytes (a gzip writer reset per message was 4 % of the command
// benchmark's CPU).
const CompressMinBytes = 1024

// ClientOptions returns the Connect options of every client: OpenTelemetry
// tracing that propagates trace context to the server, and the calls'
// histogram (rpc.client.call.duration) recorded through metrics (nil: the
// global MeterProvider).
func ClientOptions(metrics *telemetry.Metrics) []connect.ClientOption {
	otel, err := otelconnect.NewInterceptor(otelconnect.WithMeterProvider(metrics.MeterProvider()))
	if err != nil {
		panic(err)
	}
	return []connect.ClientOption{connect.WithInterceptors(otel)}
}

// maskInternal returns the interceptor that gives clients PublicError of
// every handler error, unary and streaming, and logs the real error of those
// it replaced, so that SQL and internals never reach clients.
func maskInternal(logger *slog.Logger) connect.Interceptor { return &masker{logger: logger} }

type masker struct{ logger *slog.Logger }

func (m *masker) mask(ctx context.Context, procedure string, err error) error {
	public, masked := PublicError(err)
	if masked {
		if connect.CodeOf(public) == connect.CodeUnavailable {
			m.logger.WarnContext(ctx, "database unavailable", "procedure", procedure, "err", err)
		} else {
			m.logger.ErrorContext(ctx, "internal error", "procedure", procedure, "err", err)
		}
	}
	return public
}

func (m *masker) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		res, err := next(ctx, req)
		if err != nil && !req.Spec().IsClient {
			return nil, m.mask(ctx, req.Spec().Procedure, err)
		}
		return res, err
	}
}

func (m *masker) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (m *masker) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := next(ctx, conn); err != nil {
			return m.mask(ctx, conn.Spec().Procedure, err)
		}
		return nil
	}
}

// Messages of the errors PublicError puts in place of internal ones.
const (
	// MsgInternal is the message of a masked Internal error.
	MsgInternal = "internal error"
	// MsgUnavailable is the message of a failure to reach the database.
	MsgUnavailable = "the database is unavailable; retry later"
)

// PublicError returns the error a client is given for err, an error a
// handler ended with: an Internal or Unknown error (a Connect error of
// those codes, or any plain error) becomes Unavailable (MsgUnavailable)
// when its cause is a failure to reach the database (store.IsUnavailable:
// a failed connect or acquire, a network error, a server shutting down or
// starting), so that clients retry, and Internal (MsgInternal) otherwise.
// Other Connect errors, and nil, pass unchanged. masked reports that err
// was replaced: the caller logs it, as its text may hold SQL or host names.
func PublicError(err error) (public error, masked bool) {
	if err == nil {
		return nil, false
	}
	if code := connect.CodeOf(err); code != connect.CodeInternal && code != connect.CodeUnknown {
		return err, false
	}
	if store.IsUnavailable(err) {
		return connect.NewError(connect.CodeUnavailable, errors.New(MsgUnavailable)), true
	}
	return connect.NewError(connect.CodeInternal, errors.New(MsgInternal)), true
}

// Check is one readiness check of a health endpoint (GET /readyz). The
// text of the error it returns is the endpoint's answer, which anyone who
// reaches the port reads: a fixed reason ("database unreachable"), never a
// dependency's own error, which the check logs instead (its text may hold
// host names, users, SQL).
type Check func(ctx context.Context) error

// HealthHandler answers with 200 "ok" when every check passes within 2 s,
// and 503 "unhealthy: <first failure's text>" otherwise; without checks it
// always answers 200 (GET /healthz: the process is alive).
func HealthHandler(checks ...Check) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		for _, c := range checks {
			if err := c(ctx); err != nil {
				http.Error(w, "unhealthy: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
}

// Healthcheck GETs url and returns the process exit code for a container
// health check: 0 when it answered 200, 1 otherwise. An https URL's
// certificate is not verified: the check asks the service's own port on
// the loopback address, which its certificate does not name, and sends
// nothing secret.
func Healthcheck(url string) int {
	c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}, //nolint:gosec // the loopback probe of the process itself, see above
	}}
	resp, err := c.Get(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, "healthcheck:", err)
		return 1
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintln(os.Stderr, "healthcheck:", resp.Status)
		return 1
	}
	return 0
}
