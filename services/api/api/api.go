// Package api serves better-compute's public Connect API under
// /api/compute/ (bc.compute.v1: NodeService, PoolService, ReservationService,
// UsageService, JoinTokenService, TenantService, TokenService, AuditService,
// CommandService, EventService), the NDJSON events watch
// GET /api/compute/watch (events.go) and GET /healthz.
//
// Every request is authenticated by an API token (pkg/iam) and authorized by
// the per-RPC table in authz.go; handlers then scope what they read and write
// to the caller's tenant (root administrators see every tenant), and another
// tenant's resource reads as NotFound. Every call of a mutating RPC writes
// one audit row: handlers write the success row in the transaction of their
// change (auditInTx), the audit interceptor writes refusals. Store errors
// become Connect codes in mapError (errors.go).
//
// To add an RPC: implement it on its service type, add its procedure to
// Policy (Mutating and Target when it changes state, and then call auditInTx
// in its transaction), add its row to the matrix in iam_test.go, and map any
// new store sentinel or constraint in mapError.
package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"

	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/batch"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/pki"
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
	// WellKnown configures GET /.well-known/better-compute (wellknown.go).
	WellKnown WellKnownConfig
	// SignedIntent signs the NodeSpecs the API changes (a release drops an
	// allocation) with the command-signing root, read from
	// WellKnown.PKIDir (env BC_SIGNED_INTENT, false; see pkg/store
	// IntentSigner). Turn it on wherever the controllers sign: daemons that
	// joined with signedIntent refuse unsigned specs.
	SignedIntent bool
	// Watch tunes the events watch (events.go); zero: the defaults.
	Watch WatchConfig
	// TokenCacheTTL is how long a valid API token's row answers calls
	// without a query (iam.Authenticator.CacheTTL; env
	// BC_TOKEN_CACHE_TTL): 0 is iam.DefaultTokenCacheTTL (1 s), negative
	// caches nothing. A token revoked through this server is refused at
	// once; through another, once its revocation message arrives on NATS
	// (Deps.NC), or after TokenCacheTTL at worst.
	TokenCacheTTL time.Duration
}

// ConfigFromEnv reads Config from the environment.
func ConfigFromEnv() Config {
	return Config{Listen: service.Env("BC_LISTEN", DefaultListen), WellKnown: wellKnownConfigFromEnv()}
}

// Deps are the API server's collaborators.
type Deps struct {
	DB     *store.DB
	Logger *slog.Logger
	// NC, when set, wakes event watches as soon as the outbox relay
	// publishes an event (bc.events.>); without it they poll the events
	// table every WatchConfig.Poll. It also carries the revocations of API
	// tokens by other API servers (store.SubjectAPITokenRevoked), which
	// drop the token from this server's cache; without it a token revoked
	// elsewhere works here for up to Config.TokenCacheTTL.
	NC *nats.Conn
	// Clock times the events watch; nil is DB.Clock.
	Clock clock.Clock
}

// Server is the API server.
type Server struct {
	cfg    Config
	db     *store.DB
	logger *slog.Logger
	authn  *iam.Authenticator
	// revoked is the subscription to store.SubjectAPITokenRevoked; nil
	// without NC.
	revoked *nats.Subscription
	// wellKnown serves pki.WellKnownPath (wellknown.go).
	wellKnown http.Handler
	// intent signs changed NodeSpecs; nil without Config.SignedIntent.
	intent *store.IntentSigner
	// nc wakes event watches; nil: they poll.
	nc    *nats.Conn
	clock clock.Clock
	// stopWatches is closed when Serve's context ends, ending every watch
	// (Unavailable) so that shutdown does not wait for them.
	stopWatches chan struct{}
	stopOnce    sync.Once
	// queue batches RunCommand calls (commands.go), started on first use.
	queue     *batch.Batcher[queueItem, queueAnswer]
	queueOnce sync.Once
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
	wellKnown, err := newWellKnownHandler(cfg.WellKnown)
	if err != nil {
		return nil, err
	}
	var intent *store.IntentSigner
	if cfg.SignedIntent {
		if cfg.WellKnown.PKIDir == "" {
			return nil, errors.New("api: signedIntent needs the PKI directory (BC_PKI_DIR)")
		}
		if intent, err = store.LoadIntentSigner(cfg.WellKnown.PKIDir); err != nil {
			return nil, fmt.Errorf("api: %w", err)
		}
	}
	if deps.Clock == nil {
		deps.Clock = deps.DB.Clock
	}
	authn := iam.NewAuthenticator(deps.DB)
	if cfg.TokenCacheTTL != 0 {
		authn.CacheTTL = cfg.TokenCacheTTL
	}
	s := &Server{cfg: cfg, db: deps.DB, logger: deps.Logger, authn: authn, wellKnown: wellKnown,
		intent: intent, nc: deps.NC, clock: deps.Clock, stopWatches: make(chan struct{})}
	if deps.NC != nil {
		if s.revoked, err = deps.NC.Subscribe(store.SubjectAPITokenRevoked, s.tokenRevoked); err != nil {
			return nil, fmt.Errorf("api: subscribe to %s: %w", store.SubjectAPITokenRevoked, err)
		}
	}
	return s, nil
}

// tokenRevoked drops the token a store.SubjectAPITokenRevoked message
// names from the cache, or every cached token when the payload does not
// name one.
func (s *Server) tokenRevoked(m *nats.Msg) {
	var p store.APITokenRevoked
	if err := json.Unmarshal(m.Data, &p); err != nil {
		s.logger.Warn("api token revocation message unreadable; dropping every cached token", "err", err)
		p.TokenID = ""
	}
	s.authn.Invalidate(p.TokenID)
}

// Handler returns the API's HTTP handler: the Connect services under
// PathPrefix, GET /healthz (which pings the database) and the
// unauthenticated GET /.well-known/better-compute (wellknown.go).
func (s *Server) Handler() http.Handler {
	// Auditing runs just inside tracing, so that it records every refusal
	// of a mutating call with messages already masked. Authentication and
	// authorization run before validation, so that a caller without a
	// valid token is told only that (Unauthenticated) whatever it sent.
	opts := service.HandlerOptionsAround(s.logger,
		[]connect.Interceptor{iam.NewAuditInterceptor(s.db, Policy, s.logger)},
		[]connect.Interceptor{iam.NewInterceptor(s.authn, Policy)})
	api := http.NewServeMux()
	api.Handle(computev1connect.NewNodeServiceHandler(&nodeService{s}, opts...))
	api.Handle(computev1connect.NewPoolServiceHandler(&poolService{s}, opts...))
	api.Handle(computev1connect.NewReservationServiceHandler(&reservationService{s}, opts...))
	api.Handle(computev1connect.NewUsageServiceHandler(&usageService{s}, opts...))
	api.Handle(computev1connect.NewJoinTokenServiceHandler(&joinTokenService{s}, opts...))
	api.Handle(computev1connect.NewTenantServiceHandler(&tenantService{s}, opts...))
	api.Handle(computev1connect.NewTokenServiceHandler(&tokenService{s}, opts...))
	api.Handle(computev1connect.NewAuditServiceHandler(&auditService{s}, opts...))
	api.Handle(computev1connect.NewEventServiceHandler(&eventService{s}, opts...))
	api.Handle(computev1connect.NewCommandServiceHandler(&commandService{s}, opts...))

	mux := http.NewServeMux()
	mux.Handle(PathPrefix+"/", http.StripPrefix(PathPrefix, api))
	mux.HandleFunc("GET "+WatchPath, s.serveWatch)
	mux.Handle("/healthz", service.HealthHandler(func(ctx context.Context) error { return s.db.Pool.Ping(ctx) }))
	mux.Handle("GET "+pki.WellKnownPath, s.wellKnown)
	return mux
}

// Run serves on cfg.Listen until ctx ends.
func (s *Server) Run(ctx context.Context) error { return s.Serve(ctx, nil) }

// Serve serves on ln (or cfg.Listen when ln is nil) until ctx ends.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, s.StopWatches)
	defer stop()
	defer s.Close()
	return service.Serve(ctx, s.logger, service.NewServer(s.cfg.Listen, s.Handler()), ln)
}

// Close stops the server's background work (the command queue's workers,
// the subscription to token revocations); calls still queued fail with
// Unavailable. Serve calls it when it returns; a caller of Handler alone
// calls it when done.
func (s *Server) Close() {
	if s.revoked != nil {
		_ = s.revoked.Unsubscribe() // fails only when already gone
	}
	s.commandQueue().Close()
}

// StopWatches ends every events watch, now and to come, with Unavailable
// (clients resume elsewhere or later); Serve calls it when its context ends.
func (s *Server) StopWatches() { s.stopOnce.Do(func() { close(s.stopWatches) }) }

// auditInTx writes the audit row of the current call, a successful call of
// a Mutating RPC, in tx: the transaction of its change, so that the change
// and its row commit together. target is the id of the resource acted on
// (the new one, for a create); detail says what changed. Call it at the end
// of the transaction's function; refusals are written by the audit
// interceptor. Errors: the RPC is not Mutating in Policy, or the database's.
func (s *Server) auditInTx(ctx context.Context, tx store.DBTX, target, detail string) error {
	return iam.AuditInTx(ctx, tx, s.db.Now(), target, detail)
}

// principal returns the caller authenticated by the interceptor.
func principal(ctx context.Context) (iam.Principal, error) {
	p, ok := iam.PrincipalFrom(ctx)
	if !ok {
		return iam.Principal{}, connect.NewError(connect.CodeInternal, errors.New("no principal in context"))
	}
	return p, nil
}
