// Package api serves better-compute's public Connect API under
// /api/compute/ (bc.compute.v1: NodeService, PoolService, JoinTokenService)
// and GET /healthz.
//
// Every request is authenticated by an API token (pkg/iam) and authorized by
// the per-RPC table in authz.go; handlers then scope what they read and write
// to the caller's tenant (root administrators see every tenant). Store errors
// become Connect codes in mapError (errors.go).
//
// To add an RPC: implement it on its service type, add its procedure to
// Policy, and map any new store sentinel or constraint in mapError.
package api

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// DefaultListen is the API's default address.
const DefaultListen = ":8080"

// PathPrefix is where the Connect services are mounted; clients use
// <base URL>/api/compute as their Connect base URL.
const PathPrefix = "/api/compute"

// Config configures the API server.
type Config struct {
	// Listen is the HTTP address (BC_LISTEN).
	Listen string
}

// ConfigFromEnv reads Config from the environment.
func ConfigFromEnv() Config {
	return Config{Listen: service.Env("BC_LISTEN", DefaultListen)}
}

// Deps are the API server's collaborators.
type Deps struct {
	DB     *store.DB
	Logger *slog.Logger
}

// Server is the API server.
type Server struct {
	cfg    Config
	db     *store.DB
	logger *slog.Logger
	authn  *iam.Authenticator
}

// New returns a Server.
func New(cfg Config, deps Deps) (*Server, error) {
	if deps.DB == nil {
		return nil, errors.New("api: no database")
	}
	if deps.Logger == nil {
		deps.Logger = telemetry.Discard()
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	return &Server{cfg: cfg, db: deps.DB, logger: deps.Logger, authn: &iam.Authenticator{DB: deps.DB}}, nil
}

// Handler returns the API's HTTP handler: the Connect services under
// PathPrefix and GET /healthz (which pings the database).
func (s *Server) Handler() http.Handler {
	// Authorization runs innermost, after tracing, validation and error
	// masking (service.HandlerOptions), so its failures are traced and a
	// database error while authenticating is masked like any other.
	opts := append(service.HandlerOptions(s.logger), connect.WithInterceptors(iam.NewInterceptor(s.authn, Policy)))
	api := http.NewServeMux()
	api.Handle(computev1connect.NewNodeServiceHandler(&nodeService{s}, opts...))
	api.Handle(computev1connect.NewPoolServiceHandler(&poolService{s}, opts...))
	api.Handle(computev1connect.NewJoinTokenServiceHandler(&joinTokenService{s}, opts...))

	mux := http.NewServeMux()
	mux.Handle(PathPrefix+"/", http.StripPrefix(PathPrefix, api))
	mux.Handle("/healthz", service.HealthHandler(func(ctx context.Context) error { return s.db.Pool.Ping(ctx) }))
	return mux
}

// Run serves on cfg.Listen until ctx ends.
func (s *Server) Run(ctx context.Context) error { return s.Serve(ctx, nil) }

// Serve serves on ln (or cfg.Listen when ln is nil) until ctx ends.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	return service.Serve(ctx, s.logger, service.NewServer(s.cfg.Listen, s.Handler()), ln)
}

// principal returns the caller authenticated by the interceptor.
func principal(ctx context.Context) (iam.Principal, error) {
	p, ok := iam.PrincipalFrom(ctx)
	if !ok {
		return iam.Principal{}, connect.NewError(connect.CodeInternal, errors.New("no principal in context"))
	}
	return p, nil
}
