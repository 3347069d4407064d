package cli

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/service"
)

const (
	defaultURL = "http://127.0.0.1:8080"
	// apiPath is where the API mounts its Connect services.
	apiPath = "/api/compute"
)

// apiClients are the Connect clients of the public API.
type apiClients struct {
	nodes     computev1connect.NodeServiceClient
	pools     computev1connect.PoolServiceClient
	res       computev1connect.ReservationServiceClient
	usage     computev1connect.UsageServiceClient
	tokens    computev1connect.JoinTokenServiceClient
	tenants   computev1connect.TenantServiceClient
	apiTokens computev1connect.TokenServiceClient
	audit     computev1connect.AuditServiceClient
	commands  computev1connect.CommandServiceClient
	tunnels   computev1connect.TunnelServiceClient
}

// baseURL returns the API's base URL: --url, else BETTER_COMPUTE_URL, else
// the default, without a trailing slash or /api/compute. The error names
// the flag or variable when the URL is not http:// or https:// with a host.
func (a *app) baseURL() (string, error) {
	u, from := a.url, "--url"
	if u == "" {
		u, from = a.env.Getenv("BETTER_COMPUTE_URL"), "BETTER_COMPUTE_URL"
	}
	if u == "" {
		u = defaultURL
	}
	if p, err := url.Parse(u); err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
		return "", fmt.Errorf("%s: want http://HOST[:PORT] or https://HOST[:PORT], got %q", from, u)
	}
	u = strings.TrimRight(u, "/")
	return strings.TrimSuffix(u, apiPath), nil
}

// clients returns API clients that authenticate with --token or
// BETTER_COMPUTE_TOKEN and send BETTER_COMPUTE_TENANT as X-BC-Tenant, and,
// with an OTLP endpoint set, trace their calls (trace.go).
func (a *app) clients() (*apiClients, error) {
	token, err := a.apiToken()
	if err != nil {
		return nil, err
	}
	tenant := a.env.Getenv("BETTER_COMPUTE_TENANT")
	headers := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("Authorization", "Bearer "+token)
			if tenant != "" {
				req.Header().Set("X-BC-Tenant", tenant)
			}
			return next(ctx, req)
		}
	})
	hc := &http.Client{Timeout: 60 * time.Second}
	base, err := a.baseURL()
	if err != nil {
		return nil, err
	}
	base += apiPath
	t, err := a.tracing()
	if err != nil {
		return nil, err
	}
	traced, err := t.interceptors()
	if err != nil {
		return nil, err
	}
	opt := connect.WithInterceptors(append([]connect.Interceptor{lostConnection{}, headers}, traced...)...)
	return &apiClients{
		nodes:     computev1connect.NewNodeServiceClient(hc, base, opt),
		pools:     computev1connect.NewPoolServiceClient(hc, base, opt),
		res:       computev1connect.NewReservationServiceClient(hc, base, opt),
		usage:     computev1connect.NewUsageServiceClient(hc, base, opt),
		tokens:    computev1connect.NewJoinTokenServiceClient(hc, base, opt),
		tenants:   computev1connect.NewTenantServiceClient(hc, base, opt),
		apiTokens: computev1connect.NewTokenServiceClient(hc, base, opt),
		audit:     computev1connect.NewAuditServiceClient(hc, base, opt),
		commands:  computev1connect.NewCommandServiceClient(hc, base, opt),
		tunnels:   computev1connect.NewTunnelServiceClient(hc, base, opt),
	}, nil
}

// apiToken returns --token, else BETTER_COMPUTE_TOKEN; an error says how to
// set one when neither is.
func (a *app) apiToken() (string, error) {
	token := a.token
	if token == "" {
		token = a.env.Getenv("BETTER_COMPUTE_TOKEN")
	}
	if token == "" {
		return "", errors.New("no API token: set BETTER_COMPUTE_TOKEN or pass --token")
	}
	return token, nil
}

// apiPeer names the API in errors about the connection to it.
const apiPeer = "the API server"

// lostConnection is a client interceptor that reports a connection to the
// API dropped in the middle of a response (the server was killed or
// restarted) as Unavailable "lost the connection to the API server: …"
// (service.ConnectionLost) rather than as connect-go's "internal: protocol
// error: incomplete envelope: unexpected EOF", so that the user reads what
// happened and the retries of `commands run --wait` and `events watch`
// (transientError) take it for the transient failure it is.
type lostConnection struct{}

func (lostConnection) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		res, err := next(ctx, req)
		return res, service.ConnectionLost(err, apiPeer)
	}
}

func (lostConnection) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		return lostConnectionConn{next(ctx, spec)}
	}
}

func (lostConnection) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// lostConnectionConn is a stream whose Receive errors pass through
// service.ConnectionLost.
type lostConnectionConn struct{ connect.StreamingClientConn }

func (c lostConnectionConn) Receive(msg any) error {
	return service.ConnectionLost(c.StreamingClientConn.Receive(msg), apiPeer)
}
