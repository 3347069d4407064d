// Package joinservice turns sealed join tokens and CSRs into node
// identities: it serves bc.join.v1.JoinService/Join over Connect (HTTP/1.1
// and h2c) and GET /healthz on one mux.
//
// A join is checked in two steps. decodeJoinRequest needs no database: it
// validates the request (protovalidate), parses the CSR and checks its
// signature, and opens the sealed token with JoinService's HPKE key (RFC
// 9180) and SHA-256 of the CSR's DER as associated data, so a token sealed to
// another deployment, tampered with, or replayed with another CSR is refused
// there. Then one transaction (shared by concurrent joins, see batcher)
// counts one use of the token, creates the node (provision state joining,
// with the machine's claims), records the certificate signed with the node CA
// and enqueues a poke for the controllers: a refused or failed join consumes
// nothing. Every JoinResponse is signed with the join signing key
// (pki.SignJoinResponse); with Config.SignedIntent it carries the
// command-signing root in trust.command_signing_root.
//
// To extend it, keep those rules: every check that can refuse happens in
// decodeJoinRequest or inside the one transaction, and nothing reaches the
// daemon unsigned.
package joinservice

import (
	"context"
	"crypto/ecdh"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"buf.build/go/protovalidate"
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
	// PKIDir holds node-ca.crt/key, serving-ca.crt, trust-domain,
	// join-encryption.key, join-signing.key and, with SignedIntent,
	// command-signing.pub (BC_PKI_DIR).
	PKIDir string
	// NodeCertTTL is how long issued node certificates are valid
	// (BC_NODE_CERT_TTL, Go duration).
	NodeCertTTL time.Duration
	// GatewayURL is where joined nodes open their sessions (BC_GATEWAY_URL):
	// one URL, or every gateway replica's URL separated by commas (sent as
	// JoinResponse.gateway_urls, the first also as gateway_url), each
	// https://HOST[:PORT]; New refuses others (pki.ParseGatewayURLs).
	GatewayURL string
	// GatewayServerName is the TLS name nodes verify on the gateway
	// (BC_GATEWAY_SERVER_NAME).
	GatewayServerName string
	// TrustDomain overrides PKIDir/trust-domain when set (BC_TRUST_DOMAIN).
	TrustDomain string
	// SignedIntent puts the command-signing root (PKIDir/command-signing.pub)
	// into every JoinResponse's trust.command_signing_root, so daemons refuse
	// unsigned commands and specs (BC_SIGNED_INTENT=true).
	SignedIntent bool
}

// ConfigFromEnv reads Config from the environment, with the defaults above.
func ConfigFromEnv() (Config, error) {
	ttl, err := service.EnvDuration("BC_NODE_CERT_TTL", DefaultNodeCertTTL)
	if err != nil {
		return Config{}, err
	}
	signed, err := envBool("BC_SIGNED_INTENT")
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
		SignedIntent:      signed,
	}, nil
}

// envBool reads a boolean environment variable ("" is false).
func envBool(key string) (bool, error) {
	v := os.Getenv(key)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("%s: %q is not true or false", key, v)
	}
	return b, nil
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
	// joinKey opens sealed tokens; signKey signs JoinResponses.
	joinKey *ecdh.PrivateKey
	signKey ed25519.PrivateKey
	// commandRoot is the command-signing root's DER SubjectPublicKeyInfo
	// (SignedIntent), nil otherwise.
	commandRoot []byte
	// batch records joins in shared transactions.
	batch *batcher
}

var _ joinv1connect.JoinServiceHandler = (*Server)(nil)

// New loads the node CA, the serving CA, the trust domain, the join
// encryption and signing keys and (with SignedIntent) the command-signing
// root from cfg.PKIDir and returns a Server. Errors name the file that is
// missing or broken.
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
	if _, err := pki.ParseGatewayURLs(cfg.GatewayURL); err != nil {
		return nil, fmt.Errorf("BC_GATEWAY_URL: %w", err)
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
	joinKey, err := pki.LoadJoinEncryptionKey(filepath.Join(cfg.PKIDir, pki.JoinEncryptionKey))
	if err != nil {
		return nil, fmt.Errorf("load join encryption key: %w", err)
	}
	signKey, err := pki.LoadSigningKey(filepath.Join(cfg.PKIDir, pki.JoinSigningKey))
	if err != nil {
		return nil, fmt.Errorf("load join signing key: %w", err)
	}
	var commandRoot []byte
	if cfg.SignedIntent {
		path := filepath.Join(cfg.PKIDir, pki.CommandSigningPub)
		pub, der, err := pki.LoadPublicKey(path)
		if err != nil {
			return nil, fmt.Errorf("load command-signing root: %w", err)
		}
		if _, ok := pub.(ed25519.PublicKey); !ok {
			return nil, fmt.Errorf("load command-signing root: %s: not an Ed25519 key", path)
		}
		commandRoot = der
	}
	return &Server{cfg: cfg, db: deps.DB, logger: deps.Logger, nodeCA: nodeCA, servingCA: servingCA, trustDomain: td,
		joinKey: joinKey, signKey: signKey, commandRoot: commandRoot, batch: &batcher{db: deps.DB}}, nil
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
	in, err := decodeJoinRequest(s.joinKey, req.Msg)
	if err != nil {
		s.logger.InfoContext(ctx, "join refused", "reason", err.Error())
		return nil, err
	}
	claims := req.Msg.GetClaims()

	// The node and its certificate are made before the token is checked:
	// signing needs no lock, and both are dropped unsent if it is refused.
	now := s.db.Now()
	nodeID := ids.New(ids.Node, now)
	cert, err := s.nodeCA.IssueNode(in.csr, nodeID, s.trustDomain, now, s.cfg.NodeCertTTL)
	if err != nil {
		return nil, s.mapError(ctx, err)
	}
	var res joinResult
	// A join whose key another join of its batch used is recorded by that
	// one; once it is, this one finds it as a retry (rejoin).
	for range 2 {
		res = s.batch.do(ctx, &joinReq{
			hash: in.tokenHash,
			cert: cert,
			node: store.NewNode{
				ID: nodeID, Hostname: claims.GetHostname(), MachineID: claims.GetMachineId(),
				Variant: claims.GetVariant(), AgentVersion: claims.GetAgentVersion(),
			},
		})
		if !errors.Is(res.err, errSameKeyInBatch) {
			break
		}
	}
	token, err := res.token, res.err
	if err != nil {
		return nil, s.mapError(ctx, err)
	}
	if res.rejoin != nil {
		if nodeID, cert, err = s.rejoin(ctx, in, *res.rejoin, token); err != nil {
			return nil, err
		}
	}
	resp, err := s.response(nodeID, cert, token.PoolID)
	if err != nil {
		return nil, err
	}
	s.logger.InfoContext(ctx, "node joined", telemetry.KeyNodeID, nodeID, telemetry.KeyPoolID, token.PoolID,
		"join_token.id", token.ID, "join_token.uses", token.Uses, "hostname", claims.GetHostname(), "retry", res.rejoin != nil)
	return connect.NewResponse(resp), nil
}

// rejoin answers a Join whose key joined already (a retry after a lost
// answer, or a machine restarted mid-join, perhaps with a new token of the
// pool): the node it joined as, with a new certificate for it, recorded like
// a renewal's. Holding the key and a valid token of the node's pool is what
// a first Join of that node needed too. It refuses the key with a token of
// another pool (AlreadyExists: a machine that joins again makes a new key),
// and the key of a revoked node (FailedPrecondition).
func (s *Server) rejoin(ctx context.Context, in joinInput, j store.JoinedKey, token store.JoinToken) (string, *x509.Certificate, error) {
	if j.PoolID != token.PoolID {
		return "", nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf(
			"csr_der: this key joined already, as node %s of another pool: a machine that joins again makes a new key", j.NodeID))
	}
	node, err := store.GetNode(ctx, s.db.Pool, j.NodeID)
	if err != nil {
		return "", nil, s.mapError(ctx, err)
	}
	if node.RevokedAt != nil {
		return "", nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf(
			"node %s was revoked: join again with a new key and a join token", j.NodeID))
	}
	now := s.db.Now()
	cert, err := s.nodeCA.IssueNode(in.csr, j.NodeID, s.trustDomain, now, s.cfg.NodeCertTTL)
	if err != nil {
		return "", nil, s.mapError(ctx, err)
	}
	if err := store.CreateNodeCert(ctx, s.db.Pool, store.NewNodeCert{Serial: pki.SerialHex(cert), NodeID: j.NodeID,
		PublicKeySHA256: pki.PublicKeySHA256(cert), NotBefore: cert.NotBefore, NotAfter: cert.NotAfter, CreatedAt: now}); err != nil {
		return "", nil, s.mapError(ctx, err)
	}
	return j.NodeID, cert, nil
}

// response is the signed JoinResponse for nodeID with cert, in poolID.
func (s *Server) response(nodeID string, cert *x509.Certificate, poolID string) (*joinv1.JoinResponse, error) {
	gw := pki.NewWellKnownGateway(s.cfg.GatewayURL, s.cfg.GatewayServerName)
	resp := &joinv1.JoinResponse{
		NodeId:            nodeID,
		CertificateDer:    cert.Raw,
		NodeCaDer:         s.nodeCA.Cert.Raw,
		GatewayUrls:       gw.URLs,
		GatewayServerName: s.cfg.GatewayServerName,
		ServingCaDer:      s.servingCA.Raw,
		TrustDomain:       s.trustDomain,
		NotAfter:          timestamppb.New(cert.NotAfter),
		PoolId:            poolID,
	}
	if s.commandRoot != nil {
		resp.Trust = &joinv1.Trust{CommandSigningRoot: s.commandRoot}
	}
	// The join is recorded: a signing failure (which only a broken key can
	// cause) leaves a node whose machine finds it again when it retries.
	if err := pki.SignJoinResponse(s.signKey, resp); err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return resp, nil
}

// joinInput is what decodeJoinRequest took from a JoinRequest.
type joinInput struct {
	// csr is the parsed CSR, its signature checked.
	csr *x509.CertificateRequest
	// tokenHash is iam.HashSecret of the opened token.
	tokenHash []byte
}

// decodeJoinRequest runs every check of a JoinRequest that needs no
// database, cheapest first: protovalidate (InvalidArgument naming the field),
// the CSR (InvalidArgument "csr_der: …": not DER PKCS#10, or not signed by
// its key), then the sealed token, opened with key and bound to the CSR's
// DER (Unauthenticated "sealed_token cannot be opened…"). Every error is a
// *connect.Error; it never panics, whatever msg holds.
func decodeJoinRequest(key *ecdh.PrivateKey, msg *joinv1.JoinRequest) (joinInput, error) {
	if err := protovalidate.Validate(msg); err != nil {
		return joinInput{}, connect.NewError(connect.CodeInvalidArgument, err)
	}
	csr, err := pki.ParseCSR(msg.GetCsrDer())
	if err != nil {
		return joinInput{}, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("csr_der: %w", err))
	}
	token, err := pki.OpenJoinToken(key, msg.GetSealedToken(), msg.GetCsrDer())
	if err != nil {
		return joinInput{}, connect.NewError(connect.CodeUnauthenticated, pki.ErrSealOpen)
	}
	return joinInput{csr: csr, tokenHash: iam.HashSecret(token)}, nil
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
