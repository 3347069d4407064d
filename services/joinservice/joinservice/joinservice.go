// Package joinservice turns sealed join tokens and CSRs into node
// identities: it serves bc.join.v1.JoinService/Join over Connect (HTTP/1.1
// and h2c), with the probes of the service lifecycle (pkg/service) beside
// it.
//
// A join is checked in two steps. decodeJoinRequest needs no database: it
// validates the request (protovalidate), parses the CSR and checks its
// signature, and opens the sealed token with JoinService's HPKE key (RFC
// 9180) and SHA-256 of the CSR's DER as associated data, so a token sealed to
// another deployment, tampered with, or replayed with another CSR is refused
// there. Then one statement, a transaction of its own (shared by concurrent
// joins, see batcher; store.RecordJoins), counts one use of the token, creates the node (provision state joining,
// with the machine's claims), records the certificate signed with the node CA
// and enqueues a poke for the controllers: a refused or failed join consumes
// nothing. Every JoinResponse is signed with the join signing key
// (pki.SignJoinResponse); with Config.SignedIntent it carries the
// command-signing root in trust.command_signing_root.
//
// JoinService also signs the certificates daemons renew over their sessions
// (renew.go): the gateways ask for them through bc.join.v1.NodeCertService
// on a control listener of its own, over mutual TLS with the serving CA's
// certificates, so that the node CA's key never leaves JoinService. A
// renewal is decided in one transaction too, and needs the daemon's proof
// (a signature by its session certificate's key), so that a gateway cannot
// get a certificate for a node that did not ask.
//
// To extend it, keep those rules: every check that can refuse happens in
// decodeJoinRequest or inside the one statement, and nothing reaches the
// daemon unsigned.
package joinservice

import (
	"context"
	"crypto/ecdh"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/protobuf/types/known/timestamppb"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/ratelimit"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Name is JoinService's name in logs, errors and `joinservice
// healthcheck`.
const Name = "joinservice"

// Config configures JoinService. The binary reads it from the environment
// (pkg/config; docs/configuration.md lists the variables); New gives every
// zero field its default. PKIDir holds node-ca.crt/key, serving-ca.crt,
// trust-domain, join-encryption.key, join-signing.key,
// joinservice.crt/key and, with SignedIntent, command-signing.pub. GatewayURL, sent as
// JoinResponse.gateway_urls, must be a list of https://HOST[:PORT], else New
// fails.
type Config struct {
	service.Database
	service.PKI
	service.Intent
	service.Gateways
	service.NodeCerts
	// Listen is the address of JoinService's Connect API and its probes
	// (GET /healthz, GET /readyz).
	Listen string `env:"LISTEN" default:":8081"`
	// Listener, when set, is where JoinService accepts connections instead
	// of Listen; Run closes it.
	Listener net.Listener
	// TrustDomain is the SPIFFE trust domain of node certificates; unset,
	// the one in PKI_DIR/trust-domain (spiffe://better-compute.local when
	// that is missing).
	TrustDomain string `env:"TRUST_DOMAIN"`
	ratelimit.Proxy
	// JoinBurst is how many Join calls one source address may make at once
	// before it is refused with ResourceExhausted (HTTP 429, Retry-After),
	// before anything of its request is read.
	JoinBurst int `env:"JOIN_BURST,positive" default:"50"`
	// JoinRate is how many more Join calls per second a source address may
	// make after its burst.
	JoinRate int `env:"JOIN_RATE,positive" default:"10"`
	// ControlListen is the address of the control listener:
	// bc.join.v1.NodeCertService, where gateways have the certificates
	// daemons renew over their sessions signed, over mutual TLS only
	// (JoinService's joinservice.crt; client certificates of the serving CA
	// with the ClientAuth usage: the gateways'). For the control plane's
	// network only, never the machines'.
	ControlListen string `env:"CONTROL_LISTEN" default:":8087"`
	// ControlListener, when set, is where the control listener accepts
	// connections instead of ControlListen (plain TCP: JoinService does TLS
	// itself); Run closes it. Tests and `better-compute dev` pass one on
	// 127.0.0.1:0.
	ControlListener net.Listener
	// RenewInterval is the least time between two certificates of one
	// node: a renewal sooner than this after the node's newest certificate
	// (issued at join or renewed, store.LastNodeCertCreatedAt), through any
	// gateway, is refused with a reason saying when to try again (pkg/daemon
	// retries with backoff). Machines renew at two thirds of a certificate's
	// lifetime, far above it. Unset or not positive: the lesser of 10
	// minutes (DefaultRenewInterval) and a tenth of NODE_CERT_TTL. At most a
	// quarter of NODE_CERT_TTL, else JoinService does not start: a machine
	// whose renewal answer was lost must be able to renew again before its
	// certificate expires.
	RenewInterval time.Duration `env:"NODE_CERT_RENEW_INTERVAL"`
	// HTTPLimits are the limits of its servers (the Connect API, the
	// control listener).
	service.HTTPLimits
	// TLS, with both files, has it serve HTTPS only: the sealed join
	// tokens and the signed answers then never cross a network in clear.
	service.TLS
}

// ProbeAddr is Listen (service.Config).
func (c Config) ProbeAddr() string { return c.Listen }

// Deps are JoinService's collaborators: DB, and optionally Logger.
type Deps = service.Deps

// Server is a running JoinService.
type Server struct {
	cfg         Config
	deps        Deps
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
	// batch records joins in shared statements.
	batch *batcher
	// checked remembers the tokens found usable before signing.
	checked tokenChecks
	// issued counts the node certificates signed (CertificatesIssued).
	issued atomic.Int64
	// joins limits Join calls per source address (joinLimit).
	joins *ratelimit.Limiter
	// tls is its server's TLS configuration; nil: plain HTTP.
	tls *tls.Config
	// joinAttempts counts Join calls (bc.join.attempts), by outcome:
	// outcomeAttrs holds each outcome's attributes.
	joinAttempts metric.Int64Counter
	outcomeAttrs *telemetry.AttrPairs
	// controlTLS is the control listener's (mutual TLS).
	controlTLS *tls.Config
}

// CertificatesIssued returns how many node certificates this server has
// signed: joins, rejoins and renewals, refused joins included when the
// refusal came after the signature.
func (s *Server) CertificatesIssued() int64 { return s.issued.Load() }

var _ joinv1connect.JoinServiceHandler = (*Server)(nil)

// New loads the node CA, the serving CA, the trust domain, the join
// encryption and signing keys, JoinService's serving certificate and (with
// SignedIntent) the command-signing root from cfg.PKIDir and returns a
// Server. Errors name the file that is missing or broken, or the setting
// that is wrong.
func New(cfg Config, deps Deps) (*Server, error) {
	deps, err := deps.Complete(Name, false)
	if err != nil {
		return nil, err
	}
	config.SetDefaults(&cfg)
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if err := checkRenewInterval(&cfg); err != nil {
		return nil, err
	}
	serverTLS, err := cfg.ServerConfig()
	if err != nil {
		return nil, fmt.Errorf("joinservice: %w", err)
	}
	nodeCA, err := pki.LoadCA(filepath.Join(cfg.PKIDir, pki.NodeCACert), filepath.Join(cfg.PKIDir, pki.NodeCAKey))
	if err != nil {
		return nil, fmt.Errorf("load node CA: %w", err)
	}
	servingCA, err := pki.LoadCert(filepath.Join(cfg.PKIDir, pki.ServingCACert))
	if err != nil {
		return nil, fmt.Errorf("load serving CA: %w", err)
	}
	controlCert, err := tls.LoadX509KeyPair(filepath.Join(cfg.PKIDir, pki.JoinServiceCert), filepath.Join(cfg.PKIDir, pki.JoinServiceKey))
	if err != nil {
		return nil, fmt.Errorf("load JoinService's serving certificate: %w", err)
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
	return &Server{cfg: cfg, deps: deps, db: deps.DB, logger: deps.Logger, nodeCA: nodeCA, servingCA: servingCA, trustDomain: td,
		joinKey: joinKey, signKey: signKey, commandRoot: commandRoot, batch: &batcher{db: deps.DB},
		joins: ratelimit.New(cfg.JoinRate, cfg.JoinBurst, 0, deps.Clock), tls: serverTLS,
		joinAttempts: telemetry.Int64Counter(deps.Meter("github.com/better-compute/better-compute/services/joinservice"),
			telemetry.JoinAttempts),
		outcomeAttrs: telemetry.NewAttrPairs(telemetry.LabelOutcome, ""),
		controlTLS:   controlTLS(controlCert, servingCA)}, nil
}

// Handler returns the mux of JoinService's Connect handler. The join limit
// runs before validation, so that a refused call costs no parsing. Its
// answers are never compressed (uncompressedAnswers).
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	opts := service.HandlerOptionsAround(s.logger, s.deps.Metrics, nil, []connect.Interceptor{s.joinLimit()})
	mux.Handle(joinv1connect.NewJoinServiceHandler(s, append(opts, uncompressedAnswers)...))
	return mux
}

// uncompressedAnswers has JoinService send every answer uncompressed, even
// to a caller that accepts gzip (requests may still come gzipped): a
// JoinResponse is mostly certificates, keys and signatures: gzip saves
// about 550 of its 1,600 bytes, once per machine, at about a tenth of
// JoinService's CPU per join (and the machine's to inflate it).
var uncompressedAnswers = connect.WithCompressMinBytes(math.MaxInt)

// joinLimit returns the interceptor that limits Join calls per source
// address (ratelimit.Source: the TCP peer, or X-Forwarded-For with
// Config.TrustForwardedFor; Config.JoinBurst, JoinRate): over the limit, a
// call is refused with ResourceExhausted "joins from this address: too
// many; retry in N s" and a Retry-After header of N (ratelimit.Error).
func (s *Server) joinLimit() connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if req.Spec().IsClient || req.Spec().Procedure != joinv1connect.JoinServiceJoinProcedure {
				return next(ctx, req)
			}
			if ok, retry := s.joins.Allow(ratelimit.Source(req.Peer().Addr, req.Header(), s.cfg.TrustForwardedFor)); !ok {
				s.logger.InfoContext(ctx, "join refused", "reason", "rate limit")
				err := ratelimit.Error("joins", retry)
				s.countJoin(ctx, connect.CodeOf(err).String())
				return nil, err
			}
			return next(ctx, req)
		}
	})
}

// countJoin counts one Join call of outcome (bc.join.attempts).
func (s *Server) countJoin(ctx context.Context, outcome string) {
	s.joinAttempts.Add(ctx, 1, s.outcomeAttrs.Get(outcome, ""))
}

// Name returns Name (service.Runner).
func (s *Server) Name() string { return Name }

// Run serves the Connect API and the probes on Config.Listen (or
// Listener), over TLS with Config.TLS, and NodeCertService on
// Config.ControlListen (or ControlListener) over mutual TLS, through the
// service lifecycle (service.Run) until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	return service.Run(ctx, service.Spec{Name: Name, Deps: s.deps, Servers: []service.HTTPServer{{
		Name: Name, Addr: s.cfg.Listen, Listener: s.cfg.Listener, Handler: s.Handler(), Probes: true,
		TLS: s.tls, Limits: s.cfg.HTTPLimits,
	}, {
		Name: "control", Addr: s.cfg.ControlListen, Listener: s.cfg.ControlListener, Handler: s.ControlHandler(),
		TLS: s.controlTLS, Tune: s.tuneControl, Limits: s.cfg.HTTPLimits,
	}}})
}

// tuneControl makes the control server HTTP/2 only (its clients are the
// gateways' Connect clients) and logs what net/http reports, refused TLS
// handshakes among it, as warnings.
func (s *Server) tuneControl(srv *http.Server) {
	var p http.Protocols
	p.SetHTTP2(true)
	srv.Protocols = &p
	srv.ErrorLog = slog.NewLogLogger(s.logger.With("server", "control").Handler(), slog.LevelWarn)
}

// Join implements bc.join.v1.JoinService/Join; see the proto for errors.
// It counts each call by outcome (bc.join.attempts: joined, rejoined, or
// the Connect code of its error).
func (s *Server) Join(ctx context.Context, req *connect.Request[joinv1.JoinRequest]) (_ *connect.Response[joinv1.JoinResponse], err error) {
	rejoined := false
	defer func() {
		outcome := "joined"
		switch {
		case err != nil:
			outcome = connect.CodeOf(err).String()
		case rejoined:
			outcome = "rejoined"
		}
		s.countJoin(ctx, outcome)
	}()
	in, err := decodeJoinRequest(s.joinKey, req.Msg)
	if err != nil {
		s.logger.InfoContext(ctx, "join refused", "reason", err.Error())
		return nil, err
	}
	claims := req.Msg.GetClaims()

	// An unknown, revoked or expired token is refused before anything is
	// signed (a token found usable in the last second is not read again:
	// tokenChecks). The node and its certificate are then made before the
	// token is locked and its use counted (signing needs no lock), and both
	// are dropped unsent if that refuses it.
	now := s.db.Now()
	if _, err := s.checked.check(ctx, s.db, in.tokenHash, now); err != nil {
		return nil, s.mapError(ctx, err)
	}
	nodeID := ids.New(ids.Node, now)
	cert, err := s.nodeCA.IssueNode(in.csr, nodeID, s.trustDomain, now, s.cfg.NodeCertTTL)
	if err != nil {
		return nil, s.mapError(ctx, err)
	}
	s.issued.Add(1)
	var res joinResult
	// A join whose key another join of its batch used is recorded by that
	// one; once it is, this one finds it as a retry (rejoin). A batch that
	// met a key joined concurrently by another replica's batch rolled back
	// whole (ConstraintNodeJoinKey): its joins are recorded again, and that
	// one finds its node.
	for range 3 {
		res = s.batch.do(ctx, &joinReq{
			hash: in.tokenHash,
			cert: cert,
			node: store.NewNode{
				ID: nodeID, Hostname: claims.GetHostname(), MachineID: claims.GetMachineId(),
				Variant: claims.GetVariant(), AgentVersion: claims.GetAgentVersion(),
			},
		})
		if !errors.Is(res.err, store.ErrSameKeyInBatch) && !store.IsConstraint(res.err, store.ConstraintNodeJoinKey) {
			break
		}
	}
	token, err := res.token, res.err
	if err != nil {
		return nil, s.mapError(ctx, err)
	}
	if res.rejoin != nil {
		rejoined = true
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
	node, err := store.GetNode(ctx, s.db.Pool, store.AllTenants, j.NodeID)
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
	s.issued.Add(1)
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
// DER (Unauthenticated "sealed_token cannot be opened…"), and what it
// holds: a token that is not a well-formed join token (wellFormedJoinToken)
// is refused as an unknown one is (Unauthenticated "join token is not
// valid"). Every error is a *connect.Error; it never panics, whatever msg
// holds.
func decodeJoinRequest(key *ecdh.PrivateKey, msg *joinv1.JoinRequest) (joinInput, error) {
	if err := service.Validate(msg); err != nil {
		return joinInput{}, err
	}
	csr, err := pki.ParseCSR(msg.GetCsrDer())
	if err != nil {
		return joinInput{}, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("csr_der: %w", err))
	}
	token, err := pki.OpenJoinToken(key, msg.GetSealedToken(), msg.GetCsrDer())
	if err != nil {
		return joinInput{}, connect.NewError(connect.CodeUnauthenticated, pki.ErrSealOpen)
	}
	if !wellFormedJoinToken(token) {
		return joinInput{}, connect.NewError(connect.CodeUnauthenticated, &store.JoinTokenRefusal{Reason: store.ErrJoinTokenUnknown})
	}
	return joinInput{csr: csr, tokenHash: iam.HashSecret(token)}, nil
}

// joinTokenChars is the length of a join token's random part: 32 bytes in
// unpadded base64url (iam.NewSecret).
const joinTokenChars = 43

// wellFormedJoinToken reports whether s is a join token as iam.NewSecret
// makes it: iam.JoinTokenPrefix followed by the canonical unpadded
// base64url encoding (RFC 4648 section 5) of 32 bytes.
func wellFormedJoinToken(s string) bool {
	body, ok := strings.CutPrefix(s, iam.JoinTokenPrefix)
	if !ok || len(body) != joinTokenChars {
		return false
	}
	b, err := base64.RawURLEncoding.Strict().DecodeString(body)
	return err == nil && len(b) == 32
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
