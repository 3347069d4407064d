// Command joinservice serves bc.join.v1.JoinService: join tokens and CSRs in,
// node certificates out. Configuration is the environment:
// BETTER_COMPUTE_DATABASE_URL, BC_LISTEN (:8081), BC_PKI_DIR
// (/var/lib/better-compute/pki), BC_NODE_CERT_TTL (24h), BC_GATEWAY_URL
// (https://gateway:8443), BC_GATEWAY_SERVER_NAME (gateway), BC_TRUST_DOMAIN
// (from the PKI directory). `joinservice healthcheck [URL]` probes /healthz.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := "http://127.0.0.1:8081/healthz"
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(service.Healthcheck(url))
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "joinservice:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := joinservice.ConfigFromEnv()
	if err != nil {
		return err
	}
	dbURL := os.Getenv("BETTER_COMPUTE_DATABASE_URL")
	if dbURL == "" {
		return errors.New("BETTER_COMPUTE_DATABASE_URL is not set")
	}
	logger, shutdown, err := telemetry.Setup(ctx, "joinservice")
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdown(sctx)
	}()
	db, err := store.Open(ctx, dbURL, clock.New(), 60*time.Second, store.Options{})
	if err != nil {
		return err
	}
	defer db.Close()
	srv, err := joinservice.New(cfg, joinservice.Deps{DB: db, Logger: logger})
	if err != nil {
		return err
	}
	return srv.Run(ctx)
}
