package service

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/pki"
)

// The settings several services share, each declared once: a service's
// Config embeds those it reads (docs/configuration.md lists who reads
// which). Embedding Database or NATS also has Main open that dependency.

// Database is the database setting.
type Database struct {
	// DatabaseURL is the PostgreSQL database, a postgres:// URL, whose
	// user is the service's own role (bc_<service>, which `better-compute
	// migrate up --roles` sets up) or the schema's owner. Every service
	// needs it and waits up to a minute for it to answer at start;
	// `better-compute dev` starts an embedded PostgreSQL server when it is
	// unset.
	DatabaseURL string `env:"DATABASE_URL"`
}

func (d Database) databaseURL() string { return d.DatabaseURL }

// NATS is the NATS setting.
type NATS struct {
	// NATSURL is the NATS server, which carries pokes, events and token
	// revocations: hints, since Postgres stays the source of truth. The
	// services reconnect to it forever; `better-compute dev` starts an
	// embedded server when it is unset.
	NATSURL string `env:"NATS_URL" default:"nats://127.0.0.1:4222"`
}

func (n NATS) natsURL() string { return n.NATSURL }

// PKI is the setting of the deployment's PKI directory.
type PKI struct {
	// PKIDir is the service's PKI directory: the files of the deployment's
	// that it reads (`better-compute pki export --service NAME`, pkg/pki
	// Layout), or the whole directory `better-compute pki init` writes. A
	// missing file stops the service at start, naming it. Unset for the
	// API: no well-known document and no tunnels.
	PKIDir string `env:"PKI_DIR" default:"/var/lib/better-compute/pki"`
}

// Intent is the signed-intent setting.
type Intent struct {
	// SignedIntent signs every command and NodeSpec the services write with
	// the command-signing root (PKI_DIR/command-signing.key), and has
	// JoinService give joining machines that root, so that they refuse
	// unsigned intent (docs/architecture.md, "Commands"). Set it alike for
	// every service.
	SignedIntent bool `env:"SIGNED_INTENT"`
}

// Gateways is where machines open their sessions.
type Gateways struct {
	// GatewayURL is where machines open their sessions: one https://HOST[:PORT]
	// or every gateway replica's, separated by commas (a machine moves to the
	// next when it loses one). JoinService sends them in JoinResponses; the
	// API publishes them in its well-known document, which has none when it
	// is unset there.
	GatewayURL string `env:"GATEWAY_URL" default:"https://gateway:8443"`
	// GatewayServerName is the TLS name machines verify on the gateways.
	GatewayServerName string `env:"GATEWAY_SERVER_NAME" default:"gateway"`
}

// Check fails, naming GATEWAY_URL, when GatewayURL is not a list of
// https://HOST[:PORT] URLs (pki.ParseGatewayURLs).
func (g Gateways) Check() error {
	if _, err := pki.ParseGatewayURLs(g.GatewayURL); err != nil {
		return &config.Error{Name: config.Prefix + "GATEWAY_URL", Err: err}
	}
	return nil
}

// NodeCerts is the lifetime of node certificates.
type NodeCerts struct {
	// NodeCertTTL is how long a node certificate is valid, issued by
	// JoinService at join and when a machine renews it over its session
	// (through its gateway); machines renew at two thirds of it.
	NodeCertTTL time.Duration `env:"NODE_CERT_TTL,positive" default:"24h"`
}

// Leases are the settings of the leases that elect one replica per role
// (pkg/lease): the scheduler's and the controllers' reconcilers'.
type Leases struct {
	// LeaseTTL is how long a lease lasts without renewal: a dead replica's
	// work resumes elsewhere within about this long.
	LeaseTTL time.Duration `env:"LEASE_TTL,positive" default:"15s"`
	// Holder names this replica in the leases table; unset, the service
	// makes one, <hostname>-<8 random hex digits>, unique per process.
	Holder string `env:"LEASE_HOLDER"`
}

// Lease returns the lease named name of this replica (l.Holder, which the
// caller has filled in), on deps' database and clock.
func (l Leases) Lease(name string, deps Deps) *lease.Lease {
	return &lease.Lease{DB: deps.DB, Name: name, Holder: l.Holder, TTL: l.LeaseTTL, Clock: deps.Clock, Logger: deps.Logger}
}

// Probes is the setting of a service's own probes server (GET /healthz, GET
// /readyz, plain HTTP), for a service that has no HTTP listener of its own
// to mount them on: the scheduler, the controllers, and the gateway (whose
// sessions listener takes only machines' certificates). An embedding sets
// its port: service.Probes `default:"HEALTH_LISTEN=:8083"`.
type Probes struct {
	// HealthListen is the address of the probes server (GET /healthz, GET
	// /readyz, plain HTTP); a standby replica, without its leases, is ready
	// too.
	HealthListen string `env:"HEALTH_LISTEN"`
	// HealthListener, when set, is where the probes server accepts
	// connections instead of HealthListen; Run closes it.
	HealthListener net.Listener
	// NoHealthServer runs no probes server (`better-compute dev`, tests).
	NoHealthServer bool
}

// ProbeAddr is HealthListen (Config).
func (p Probes) ProbeAddr() string { return p.HealthListen }

// Servers returns the probes server for Spec.Servers: none with
// NoHealthServer.
func (p Probes) Servers() []HTTPServer {
	if p.NoHealthServer {
		return nil
	}
	return []HTTPServer{{Name: "health", Addr: p.HealthListen, Listener: p.HealthListener, Probes: true}}
}

// HTTPLimits are the limits of a service's HTTP servers (Run builds every
// server of a Spec with its HTTPServer's; NewServer), each server's own: the
// gateway's sessions, control and probes servers each hold
// HTTP_MAX_CONNECTIONS. A zero field is its default. The servers carry
// long-lived streams (sessions, tunnels, watches), so they have no
// http.Server ReadTimeout or WriteTimeout, which would cut them: every
// request gets HTTPRequestTimeout instead, through http.ResponseController,
// until its handler declares it a long-lived stream (LongLived), which
// bounds itself. The scheduler's and the controllers' probes servers have
// the defaults.
type HTTPLimits struct {
	// HTTPReadHeaderTimeout is how long a client has, once it connected or
	// its connection went idle, to finish sending a request's headers; it
	// bounds a TLS handshake too.
	HTTPReadHeaderTimeout time.Duration `env:"HTTP_READ_HEADER_TIMEOUT,positive" default:"10s"`
	// HTTPIdleTimeout closes a connection that had no request in flight for
	// this long (HTTP/1.1 keep-alive, HTTP/2 without streams).
	HTTPIdleTimeout time.Duration `env:"HTTP_IDLE_TIMEOUT,positive" default:"2m"`
	// HTTPRequestTimeout bounds reading a request's body and writing its
	// response (a unary call, a probe); a request still reading or writing
	// then fails, its connection (HTTP/1.1) or stream (HTTP/2) reset. The
	// long-lived streams are exempt and bounded otherwise: sessions by the
	// hello and idle timeouts, tunnels by their own idle timeout, and the
	// events watches' writes by this timeout each.
	HTTPRequestTimeout time.Duration `env:"HTTP_REQUEST_TIMEOUT,positive" default:"1m"`
	// HTTPMaxConnections is the most connections one server holds at once;
	// more wait, unaccepted, until one closes.
	HTTPMaxConnections int `env:"HTTP_MAX_CONNECTIONS,positive" default:"4096"`
	// HTTPMaxStreams is the most concurrent streams (requests) of one
	// HTTP/2 connection. The gateway's sessions server has its own:
	// GATEWAY_TUNNELS_PER_NODE + 4, what one machine needs (its session
	// and its tunnels).
	HTTPMaxStreams int `env:"HTTP_MAX_STREAMS,positive" default:"100"`
}

// TLS is the setting of a service's own TLS (the API's, JoinService's), so
// that bearer tokens and join tokens need not cross a network in clear.
type TLS struct {
	// TLSCert is a PEM file holding the service's TLS certificate (its chain
	// after it). With TLS_KEY, the service serves HTTPS only (HTTP/2 by
	// ALPN, and HTTP/1.1), its probes included; with neither, plain HTTP and
	// h2c, for a private network (compose, `better-compute dev`). One
	// without the other stops the service at start.
	TLSCert string `env:"TLS_CERT"`
	// TLSKey is the PEM file of TLS_CERT's private key.
	TLSKey string `env:"TLS_KEY"`
}

// ServerConfig returns the TLS configuration of t's certificate (TLS 1.2
// and later), or nil when neither file is set. It fails, with a
// *config.Error naming the variable, when one file is set without the
// other or the pair cannot be loaded.
func (t TLS) ServerConfig() (*tls.Config, error) {
	switch {
	case t.TLSCert == "" && t.TLSKey == "":
		return nil, nil
	case t.TLSKey == "":
		return nil, &config.Error{Name: config.Prefix + "TLS_KEY", Err: errors.New("is required with " + config.Prefix + "TLS_CERT")}
	case t.TLSCert == "":
		return nil, &config.Error{Name: config.Prefix + "TLS_CERT", Err: errors.New("is required with " + config.Prefix + "TLS_KEY")}
	}
	cert, err := tls.LoadX509KeyPair(t.TLSCert, t.TLSKey)
	if err != nil {
		return nil, &config.Error{Name: config.Prefix + "TLS_CERT", Err: fmt.Errorf("load %s with %s: %w", t.TLSCert, t.TLSKey, err)}
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}

// servesTLS reports whether the service serves HTTPS, for Main's
// healthcheck.
func (t TLS) servesTLS() bool { return t.TLSCert != "" }
