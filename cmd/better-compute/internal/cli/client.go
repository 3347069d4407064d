package cli

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
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
}

// baseURL returns the API's base URL: --url, else BETTER_COMPUTE_URL, else
// the default, without a trailing slash or /api/compute.
func (a *app) baseURL() string {
	u := a.url
	if u == "" {
		u = a.env.Getenv("BETTER_COMPUTE_URL")
	}
	if u == "" {
		u = defaultURL
	}
	u = strings.TrimRight(u, "/")
	return strings.TrimSuffix(u, apiPath)
}

// clients returns API clients that authenticate with --token or
// BETTER_COMPUTE_TOKEN and send BETTER_COMPUTE_TENANT as X-BC-Tenant.
func (a *app) clients() (*apiClients, error) {
	token := a.token
	if token == "" {
		token = a.env.Getenv("BETTER_COMPUTE_TOKEN")
	}
	if token == "" {
		return nil, errors.New("no API token: set BETTER_COMPUTE_TOKEN or pass --token")
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
	base := a.baseURL() + apiPath
	opt := connect.WithInterceptors(headers)
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
	}, nil
}
