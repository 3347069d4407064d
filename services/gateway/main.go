// Command gateway serves the daemons' Session streams over HTTP/2 with mutual
// TLS (see package gateway).
//
// Environment: BETTER_COMPUTE_DATABASE_URL (required), BETTER_COMPUTE_NATS_URL
// (nats://127.0.0.1:4222), BC_PKI_DIR (/var/lib/better-compute/pki),
// BC_LISTEN (:8443), BC_HEALTH_LISTEN (:8082), BC_GATEWAY_ID (gw-<hostname>),
// BC_HEARTBEAT_INTERVAL (10s), BC_GATEWAY_RESYNC (5s),
// BC_GATEWAY_FLUSH_INTERVAL (1s), BC_GATEWAY_IDLE_TIMEOUT (3 × heartbeat).
//
// `gateway healthcheck [URL]` GETs URL (http://127.0.0.1:8082/healthz by
// default) and exits 0 when it answers 200.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := healthURL(service.Env("BC_HEALTH_LISTEN", gateway.DefaultHealthListen))
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(service.Healthcheck(url))
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// healthURL turns a listen address (":8082") into a loopback URL.
func healthURL(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "http://127.0.0.1:8082/healthz"
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/healthz"
}

// env is the process environment the gateway reads.
type env struct {
	cfg      gateway.Config
	database string
	nats     string
}

func readEnv() (env, error) {
	var e env
	e.database = os.Getenv("BETTER_COMPUTE_DATABASE_URL")
	if e.database == "" {
		return env{}, errors.New("gateway: BETTER_COMPUTE_DATABASE_URL is required")
	}
	e.nats = service.Env("BETTER_COMPUTE_NATS_URL", nats.DefaultURL)
	e.cfg = gateway.Config{
		GatewayID:    service.Env("BC_GATEWAY_ID", gateway.DefaultGatewayID()),
		Listen:       service.Env("BC_LISTEN", gateway.DefaultListen),
		HealthListen: service.Env("BC_HEALTH_LISTEN", gateway.DefaultHealthListen),
		PKIDir:       service.Env("BC_PKI_DIR", gateway.DefaultPKIDir),
	}
	for _, d := range []struct {
		key string
		dst *time.Duration
		def time.Duration
	}{
		{"BC_HEARTBEAT_INTERVAL", &e.cfg.HeartbeatInterval, gateway.DefaultHeartbeatInterval},
		{"BC_GATEWAY_RESYNC", &e.cfg.ResyncInterval, gateway.DefaultResyncInterval},
		{"BC_GATEWAY_FLUSH_INTERVAL", &e.cfg.FlushInterval, gateway.DefaultFlushInterval},
		{"BC_GATEWAY_IDLE_TIMEOUT", &e.cfg.IdleTimeout, 0},
	} {
		v, err := service.EnvDuration(d.key, d.def)
		if err != nil {
			return env{}, fmt.Errorf("gateway: %w", err)
		}
		*d.dst = v
	}
	return e, nil
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger, shutdownTracing, err := telemetry.Setup(ctx, "gateway")
	if err != nil {
		return fmt.Errorf("gateway: telemetry: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = shutdownTracing(sctx)
	}()
	e, err := readEnv()
	if err != nil {
		return err
	}
	clk := clock.New()
	db, err := store.Open(ctx, e.database, clk, time.Minute, store.Options{})
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	defer db.Close()
	nc, err := bus.Connect(e.nats, "gateway "+e.cfg.GatewayID, logger)
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	defer nc.Close()
	srv, err := gateway.New(e.cfg, gateway.Deps{DB: db, NC: nc, Logger: logger, Clock: clk})
	if err != nil {
		return err
	}
	return srv.Run(ctx)
}
