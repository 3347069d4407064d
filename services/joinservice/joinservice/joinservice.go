// Package joinservice turns join tokens and CSRs into node identities: it
// serves bc.join.v1.JoinService/Join over Connect (HTTP/1.1 and h2c) and
// GET /healthz on one mux.
//
// A join counts one use of the token, creates the node (provision state
// joining, with the machine's claims), records the certificate it signs with
// the node CA and enqueues a poke for the controllers, all in one
// transaction: a refused or failed join consumes nothing.
//
// To extend it (sealed tokens, signed responses), keep that rule: every check
// that can refuse happens before or inside the one transaction.
package joinservice

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Defaults of Config.
const (
	DefaultListen            = ":8081"
	DefaultPKIDir            = "/var/lib/better-compute/pki"
	DefaultNodeCertTTL       = 24 * time.Hour
	DefaultGatewayURL        = "https://gateway:8443"
	DefaultGatewayServerName = "gateway"
)

// Config configures JoinService. The binary reads it from the environment
// (see ConfigFromEnv).
type Config struct {
	// Listen is the address of the Connect and health endpoints (BC_LISTEN).
	Listen string
	// PKIDir holds node-ca.crt/key, serving-ca.crt and trust-domain
	// (BC_PKI_DIR).
	PKIDir string
	// NodeCertTTL is how long issued node certificates are valid
	// (BC_NODE_CERT_TTL, Go duration).
	NodeCertTTL time.Duration
	// GatewayURL is where joined nodes open their sessions (BC_GATEWAY_URL).
	GatewayURL string
	// GatewayServerName is the TLS name nodes verify on the gateway
	// (BC_GATEWAY_SERVER_NAME).
	GatewayServerName string
	// TrustDomain overrides PKIDir/trust-domain when set (BC_TRUST_DOMAIN).
	TrustDomain string
}

// ConfigFromEnv reads Config from the environment, with the defaults above.
func ConfigFromEnv() (Config, error) {
	ttl, err := service.EnvDuration("BC_NODE_CERT_TTL", DefaultNodeCertTTL)
	if err != nil {
		return Config{}, err
	}
	return Config{
		Listen:            service.Env("BC_LISTEN", DefaultListen),
		PKIDir:            service.Env("BC_PKI_DIR", DefaultPKIDir),
		NodeCertTTL:       ttl,
		GatewayURL:        service.Env("BC_GATEWAY_URL", DefaultGatewayURL),
		GatewayServerName: service.Env("BC_GATEWAY_SERVER_NAME", DefaultGatewayServerName),
		TrustDomain:       service.Env("BC_TRUST_DOMAIN", ""),
	}, nil
}

// Deps are JoinService's collaborators.
type Deps struct {
	DB     *store.DB
	Logger *slog.Logger
}

// Server is a running JoinService.
type Server struct {
	cfg         Config
	db          *store.DB
	logger      *slog.Logger
	nodeCA      *pki.CA
	servingCA   *x509.Certificate
	trustDomain string
	// batch records joins in shared transactions.
	batch *batcher
}

var _ joinv1connect.JoinServiceHandler = (*Server)(nil)

// New loads the node CA, the serving CA and the trust domain from
// cfg.PKIDir and returns a Server. Errors name the file that is missing or
// broken.
func New(cfg Config, deps Deps) (*Server, error) {
	if deps.DB == nil {
		return nil, errors.New("joinservice: no database")
	}
	if deps.Logger == nil {
		deps.Logger = telemetry.Discard()
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.NodeCertTTL <= 0 {
		cfg.NodeCertTTL = DefaultNodeCertTTL
	}
	if cfg.GatewayURL == "" {
		cfg.GatewayURL = DefaultGatewayURL
	}
	if cfg.GatewayServerName == "" {
		cfg.GatewayServerName = DefaultGatewayServerName
	}
	nodeCA, err := pki.LoadCA(filepath.Join(cfg.PKIDir, pki.NodeCACert), filepath.Join(cfg.PKIDir, pki.NodeCAKey))
	if err != nil {
		return nil, fmt.Errorf("load node CA: %w", err)
	}
	servingCA, err := pki.LoadCert(filepath.Join(cfg.PKIDir, pki.ServingCACert))
	if err != nil {
		return nil, fmt.Errorf("load serving CA: %w", err)
	}
	td := cfg.TrustDomain
	if td == "" {
		td, err = pki.ReadTrustDomain(cfg.PKIDir)
		if err != nil {
			return nil, fmt.Errorf("read trust domain: %w", err)
		}
	}
	if td == "" {
		td = pki.DefaultTrustDomain
	}
	return &Server{cfg: cfg, db: deps.DB, logger: deps.Logger, nodeCA: nodeCA, servingCA: servingCA, trustDomain: td,
		batch: &batcher{db: deps.DB}}, nil
}

// Handler returns the mux: JoinService's Connect handler and GET /healthz
// (which pings the database).
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(joinv1connect.NewJoinServiceHandler(s, service.HandlerOptions(s.logger)...))
	mux.Handle("/healthz", service.HealthHandler(func(ctx context.Context) error { return s.db.Pool.Ping(ctx) }))
	return mux
}

// Run serves on cfg.Listen until ctx ends.
func (s *Server) Run(ctx context.Context) error { return s.Serve(ctx, nil) }

// Serve serves on ln (or cfg.Listen when ln is nil) until ctx ends.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	return service.Serve(ctx, s.logger, service.NewServer(s.cfg.Listen, s.Handler()), ln)
}

// Join implements bc.join.v1.JoinService/Join; see the proto for errors.
func (s *Server) Join(ctx context.Context, req *connect.Request[joinv1.JoinRequest]) (*connect.Response[joinv1.JoinResponse], error) {
	msg := req.Msg
	if _, ok := msg.GetCredential().(*joinv1.JoinRequest_SealedToken); ok {
		return nil, connect.NewError(connect.CodeUnimplemented,
			errors.New("sealed_token is not supported yet: send the token in clear text (token)"))
	}
	csr, err := pki.ParseCSR(msg.GetCsrDer())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("csr_der: %w", err))
	}
	hash := iam.HashSecret(msg.GetToken())
	claims := msg.GetClaims()

	// The node and its certificate are made before the token is checked:
	// signing needs no lock, and both are dropped unsent if it is refused.
	now := s.db.Now()
	nodeID := ids.New(ids.Node, now)
	cert, err := s.nodeCA.IssueNode(csr, nodeID, s.trustDomain, now, s.cfg.NodeCertTTL)
	if err != nil {
		return nil, s.mapError(ctx, err)
	}
	res := s.batch.do(ctx, &joinReq{
		hash: hash,
		cert: cert,
		node: store.NewNode{
			ID: nodeID, Hostname: claims.GetHostname(), MachineID: claims.GetMachineId(),
			Variant: claims.GetVariant(), AgentVersion: claims.GetAgentVersion(),
		},
	})
	token, err := res.token, res.err
	if err != nil {
		return nil, s.mapError(ctx, err)
	}
	s.logger.InfoContext(ctx, "node joined", telemetry.KeyNodeID, nodeID, telemetry.KeyPoolID, token.PoolID,
		"join_token.id", token.ID, "join_token.uses", token.Uses, "hostname", claims.GetHostname())
	return connect.NewResponse(&joinv1.JoinResponse{
		NodeId:            nodeID,
		CertificateDer:    cert.Raw,
		NodeCaDer:         s.nodeCA.Cert.Raw,
		GatewayUrl:        s.cfg.GatewayURL,
		GatewayServerName: s.cfg.GatewayServerName,
		ServingCaDer:      s.servingCA.Raw,
		TrustDomain:       s.trustDomain,
		NotAfter:          timestamppb.New(cert.NotAfter),
		PoolId:            token.PoolID,
	}), nil
}

// mapError turns store errors into Connect errors with messages fit for
// the machine that joins.
func (s *Server) mapError(ctx context.Context, err error) error {
	var refusal *store.JoinTokenRefusal
	if errors.As(err, &refusal) {
		code := connect.CodeFailedPrecondition
		if errors.Is(err, store.ErrJoinTokenUnknown) {
			code = connect.CodeUnauthenticated
		}
		attrs := []any{"reason", refusal.Error()}
		if refusal.Token.ID != "" {
			attrs = append(attrs, "join_token.id", refusal.Token.ID, telemetry.KeyPoolID, refusal.Token.PoolID)
		}
		s.logger.InfoContext(ctx, "join refused", attrs...)
		return connect.NewError(code, refusal)
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return connect.NewError(connect.CodeCanceled, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}
