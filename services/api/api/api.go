// Package api serves better-compute's public Connect API under
// /api/compute/ (bc.compute.v1: NodeService, PoolService, ReservationService,
// UsageService, JoinTokenService, TenantService, TokenService, AuditService,
// CommandService, EventService, TunnelService), the NDJSON events watch
// GET /api/compute/watch (events.go), the tunnels GET
// /api/compute/tunnels/{ticket} (WebSockets; tunnel_ws.go), the well-known
// document and, through the service lifecycle (pkg/service), the probes.
//
// Every request is authenticated by an API token (pkg/iam) and authorized by
// the per-RPC table in authz.go; handlers then pass the caller's scope
// (iam.Principal.Scope: its tenant, or every tenant for root administrators)
// to every store call that reads or writes tenant-owned rows, so that
// another tenant's resource reads as NotFound. Every call of a mutating RPC writes
// one audit row when its caller authenticated: handlers write the success
// row in the transaction of its change (auditInTx), the audit interceptor
// writes refusals. Calls that fail authentication write none; they are
// counted (bc.auth.failures) and limited per source address, as is ticket
// issuance (ratelimit.go); a token's open watches are capped (events.go).
// Store errors become Connect codes in mapError (errors.go).
//
// To add an RPC: implement it on its service type, passing the caller's
// scope (principal(ctx).Scope()) to the store functions it calls, add its
// procedure to Policy (Mutating and Target when it changes state, and then
// call auditInTx in its transaction), add its row to the matrix in
// iam_test.go, and map any new store sentinel or constraint in mapError.
package api

import (
	"context"
	"crypto/tls"
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
	"go.opentelemetry.io/otel/metric"

	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/batch"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/ratelimit"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Name is the API's name in logs, errors and `api healthcheck`.
const Name = "api"

// PathPrefix is where the Connect services are mounted; clients use
// <base URL>/api/compute as their Connect base URL.
const PathPrefix = "/api/compute"

// Config configures the API server. The binary reads it from the
// environment (pkg/config; docs/configuration.md lists the variables); New
// gives every zero field its default. The API reads the public files of
// PKIDir for its well-known document (wellknown.go), and with SignedIntent
// command-signing.key, to sign the NodeSpecs a release changes (a release
// drops an allocation; see pkg/store IntentSigner): turn it on wherever the
// controllers sign, since daemons that joined with signed intent refuse
// unsigned specs. With a PKI directory it also reads tunnel-ticket.key, the
// SSH user CAs and serving-ca.crt for TunnelService and the tunnels
// (tunnels.go), and New fails when one is missing. Unlike the other
// services, the API has no default PKI directory: without one it serves no
// well-known document and refuses tunnels.
type Config struct {
	service.Database
	service.NATS
	service.PKI `default:"PKI_DIR="`
	service.Intent
	ratelimit.Proxy
	// Listen is the address of the API: the Connect services, the events
	// watch, the well-known document and the probes (GET /healthz, GET
	// /readyz).
	Listen string `env:"LISTEN" default:":8080"`
	// Listener, when set, is where the API accepts connections instead of
	// Listen; Run closes it.
	Listener net.Listener
	// WellKnown configures GET /.well-known/better-compute (wellknown.go).
	WellKnown WellKnownConfig
	// Watch tunes the events watch (events.go); zero: the defaults.
	Watch WatchConfig
	// TokenCacheTTL is how long a valid API token's row answers calls
	// without a query (iam.Authenticator.CacheTTL): unset or 0 is 1 s
	// (iam.DefaultTokenCacheTTL), negative caches nothing. A token revoked
	// through this server is refused at once; through another, once its
	// revocation message arrives on NATS, or after this long at worst.
	TokenCacheTTL time.Duration `env:"TOKEN_CACHE_TTL"`
	// TokenRefusalCacheTTL is how long a well-formed API token refused
	// after a query (unknown, revoked, expired) is refused again without
	// one (iam.Authenticator.RefusalCacheTTL): unset or 0 is 2 s
	// (iam.DefaultRefusalCacheTTL), negative caches none. A token minted
	// through this server is usable at once whatever was cached.
	TokenRefusalCacheTTL time.Duration `env:"TOKEN_REFUSAL_CACHE_TTL"`
	// AuthFailureBurst is how many calls with a missing or bad API token
	// one source address may make at once before its calls are refused
	// with ResourceExhausted (HTTP 429, Retry-After) without their token
	// being looked up; a valid token this server has read valid before
	// is still looked up, and passes, whatever the address did.
	AuthFailureBurst int `env:"AUTH_FAILURE_BURST,positive" default:"50"`
	// AuthFailureRate is how many more such calls per second a source
	// address may make after its burst.
	AuthFailureRate int `env:"AUTH_FAILURE_RATE,positive" default:"10"`
	// TicketBurst is how many tunnel tickets and SSH certificates
	// (TunnelService.CreateTicket, IssueSshCertificate) one source address
	// may ask for at once before it is refused with ResourceExhausted
	// (Retry-After).
	TicketBurst int `env:"TICKET_BURST,positive" default:"50"`
	// TicketRate is how many more per second a source address may ask for
	// after its burst.
	TicketRate int `env:"TICKET_RATE,positive" default:"10"`
	// Tunnels tunes the tunnels (tunnel_ws.go).
	Tunnels TunnelConfig
	// HTTPLimits are the limits of its server. The events watches and the
	// tunnels are long-lived (service.LongLived): each write of a watch is
	// bounded by HTTPRequestTimeout, a tunnel by tunnelWriteTimeout and its
	// IdleTimeout.
	service.HTTPLimits
	// TLS, with both files, has it serve HTTPS only: the bearer tokens of
	// its callers then never cross a network in clear.
	service.TLS
}

// ProbeAddr is Listen (service.Config).
func (c Config) ProbeAddr() string { return c.Listen }

// Deps are the API server's collaborators. DB is required. NC, when set,
// wakes event watches as soon as a commit that wrote events of their tenant
// publishes its hint (bc.events.<tenant>.<type>, store.SubjectEvents), and a
// watch holding events for transactions that were running at its read
// checks them again at each such hint, of any tenant; without it they poll the events table every
// WatchConfig.Poll; it also carries the revocations of API tokens by other
// API servers (store.SubjectAPITokenRevoked), which drop the token from
// this server's cache (without it a token revoked elsewhere works here for
// up to Config.TokenCacheTTL). Clock times the events watch.
type Deps = service.Deps

// Server is the API server.
type Server struct {
	cfg    Config
	deps   Deps
	db     *store.DB
	logger *slog.Logger
	authn  *iam.Authenticator
	// revoked is the subscription to store.SubjectAPITokenRevoked; nil
	// without NC.
	revoked *nats.Subscription
	// committed is the subscription to the hints of every tenant's events
	// (store.SubjectEvents), which every commit that wrote events
	// publishes, and which wakes the watches holding events (commits); nil
	// without NC.
	committed *nats.Subscription
	// commits tells the watches holding events that a transaction that
	// wrote events committed (events.go).
	commits commitSignal
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
	// keys are the tunnels' keys (tunnels.go); nil without a PKI
	// directory.
	keys *tunnelKeys
	// gatewayClient reaches the gateways' control listeners; nil without
	// keys.
	gatewayClient *http.Client
	// tunnels are the open tunnels (tunnel_ws.go).
	tunnels tunnelRegistry
	// tickets limits ticket issuance per source address (ticketLimit).
	tickets *ratelimit.Limiter
	// watches counts the open events watches per token (events.go).
	watches watchSlots
	// tls is its server's TLS configuration; nil: plain HTTP.
	tls *tls.Config
	// queue batches RunCommand calls (commands.go), started on first use.
	queue     *batch.Batcher[queueItem, queueAnswer]
	queueOnce sync.Once
	// commandsCreated counts queued commands (bc.commands.created), by
	// kind: kindAttrs holds each kind's attributes.
	commandsCreated metric.Int64Counter
	kindAttrs       *telemetry.AttrPairs
}

// New returns a Server.
func New(cfg Config, deps Deps) (*Server, error) {
	deps, err := deps.Complete(Name, false)
	if err != nil {
		return nil, err
	}
	config.SetDefaults(&cfg)
	wellKnown, err := newWellKnownHandler(cfg.WellKnown, cfg.PKIDir)
	if err != nil {
		return nil, err
	}
	var intent *store.IntentSigner
	if cfg.SignedIntent {
		if cfg.PKIDir == "" {
			return nil, errors.New("api: signed intent needs the PKI directory (" + config.Prefix + "PKI_DIR)")
		}
		if intent, err = store.LoadIntentSigner(cfg.PKIDir); err != nil {
			return nil, fmt.Errorf("api: %w", err)
		}
	}
	if err := cfg.Tunnels.check(); err != nil {
		return nil, fmt.Errorf("api: %w", err)
	}
	serverTLS, err := cfg.ServerConfig()
	if err != nil {
		return nil, fmt.Errorf("api: %w", err)
	}
	var keys *tunnelKeys
	if cfg.PKIDir != "" {
		if keys, err = loadTunnelKeys(cfg.PKIDir); err != nil {
			return nil, fmt.Errorf("api: tunnels: %w", err)
		}
	}
	authn := iam.NewAuthenticator(deps.DB)
	if cfg.TokenCacheTTL != 0 {
		authn.CacheTTL = cfg.TokenCacheTTL
	}
	if cfg.TokenRefusalCacheTTL != 0 {
		authn.RefusalCacheTTL = cfg.TokenRefusalCacheTTL
	}
	authn.Failures = ratelimit.New(cfg.AuthFailureRate, cfg.AuthFailureBurst, 0, deps.Clock)
	s := &Server{cfg: cfg, deps: deps, db: deps.DB, logger: deps.Logger, authn: authn, wellKnown: wellKnown,
		intent: intent, nc: deps.NC, clock: deps.Clock, stopWatches: make(chan struct{}), keys: keys,
		tickets: ratelimit.New(cfg.TicketRate, cfg.TicketBurst, 0, deps.Clock), tls: serverTLS,
		commandsCreated: telemetry.Int64Counter(deps.Meter("github.com/better-compute/better-compute/services/api"),
			telemetry.CommandsCreated),
		kindAttrs: telemetry.NewAttrPairs(telemetry.LabelKind, "")}
	if keys != nil {
		s.gatewayClient = newGatewayClient(keys.gatewayTLS)
	}
	if deps.NC != nil {
		if s.revoked, err = deps.NC.Subscribe(store.SubjectAPITokenRevoked, s.tokenRevoked); err != nil {
			return nil, fmt.Errorf("api: subscribe to %s: %w", store.SubjectAPITokenRevoked, err)
		}
		if s.committed, err = deps.NC.Subscribe(store.SubjectEvents+".>", func(*nats.Msg) { s.commits.signal() }); err != nil {
			_ = s.revoked.Unsubscribe()
			return nil, fmt.Errorf("api: subscribe to %s.>: %w", store.SubjectEvents, err)
		}
	}
	return s, nil
}

// tokenRevoked drops the token a store.SubjectAPITokenRevoked message
// names from the cache, or every cached token when the payload does not
// name one, and has that token's tunnels (every tunnel) authorized again.
func (s *Server) tokenRevoked(m *nats.Msg) {
	var p store.APITokenRevoked
	if err := json.Unmarshal(m.Data, &p); err != nil {
		s.logger.Warn("api token revocation message unreadable; dropping every cached token", "err", err)
		p.TokenID = ""
	}
	s.authn.Invalidate(p.TokenID)
	s.tunnels.recheck(p.TokenID)
}

// Handler returns the API's HTTP handler: the Connect services under
// PathPrefix, the events watch, the tunnels and the unauthenticated GET
// /.well-known/better-compute (wellknown.go). Run serves it with the
// probes.
func (s *Server) Handler() http.Handler {
	// Auditing runs just inside tracing, so that it records every refusal
	// of an authenticated caller's mutating call with messages already
	// masked. Authentication and authorization run before validation, so
	// that a caller without a valid token is told only that
	// (Unauthenticated, or ResourceExhausted once its address failed too
	// often) whatever it sent; the ticket limit runs after them, so that
	// its refusals are audited with their caller.
	opts := service.HandlerOptionsChecked(s.logger, s.deps.Metrics, ruleChecks,
		[]connect.Interceptor{iam.NewAuditInterceptor(s.db, Policy, s.logger)},
		[]connect.Interceptor{iam.NewInterceptor(s.authn, Policy, s.cfg.TrustForwardedFor), s.ticketLimit()})
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
	api.Handle(computev1connect.NewTunnelServiceHandler(&tunnelService{s}, opts...))

	mux := http.NewServeMux()
	mux.Handle(PathPrefix+"/", http.StripPrefix(PathPrefix, api))
	mux.HandleFunc("GET "+WatchPath, s.serveWatch)
	mux.HandleFunc("GET "+TunnelsPath+"{ticket}", s.serveTunnel)
	mux.Handle("GET "+pki.WellKnownPath, s.wellKnown)
	return mux
}

// Name returns Name (service.Runner).
func (s *Server) Name() string { return Name }

// Run serves Handler and the probes on Config.Listen (or Listener), over
// TLS with Config.TLS, through the service lifecycle (service.Run) until ctx
// ends; then it ends the
// events watches and the tunnels (StopWatches), waits for the calls in
// flight and closes the background work (Close).
func (s *Server) Run(ctx context.Context) error {
	return service.Run(ctx, service.Spec{
		Name:  Name,
		Deps:  s.deps,
		Parts: []service.Runner{service.OnStop("background work", s.Close)},
		Servers: []service.HTTPServer{{Name: Name, Addr: s.cfg.Listen, Listener: s.cfg.Listener, Handler: s.Handler(),
			Probes: true, TLS: s.tls, Limits: s.cfg.HTTPLimits, OnShutdown: s.StopWatches}},
	})
}

// Close stops the server's background work (the command queue's workers,
// the subscription to token revocations) and ends the open tunnels
// (StopWatches), waiting for them to close (their WebSockets are the
// server's no more once upgraded); calls still queued fail with
// Unavailable. Run calls it once its server stopped; a caller of Handler
// alone calls it when done.
func (s *Server) Close() {
	if s.revoked != nil {
		_ = s.revoked.Unsubscribe() // fails only when already gone
	}
	if s.committed != nil {
		_ = s.committed.Unsubscribe()
	}
	s.commandQueue().Close()
	s.StopWatches()
	s.tunnels.closeAndWait()
	if s.gatewayClient != nil {
		s.gatewayClient.CloseIdleConnections()
	}
}

// StopWatches ends every events watch, now and to come, with Unavailable
// (clients resume elsewhere or later), and every tunnel with a Close frame
// "API shutting down" (new ones are refused with 503); Run calls it when its
// server starts shutting down.
func (s *Server) StopWatches() { s.stopOnce.Do(func() { close(s.stopWatches) }) }

// stopping reports whether StopWatches was called.
func (s *Server) stopping() bool {
	select {
	case <-s.stopWatches:
		return true
	default:
		return false
	}
}

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
