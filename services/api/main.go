// Command api serves better-compute's public Connect API under /api/compute
// and GET /healthz. Configuration is the environment:
// BETTER_COMPUTE_DATABASE_URL and BC_LISTEN (:8080). `api healthcheck [URL]`
// probes /healthz.
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
	"github.com/better-compute/better-compute/services/api/api"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := "http://127.0.0.1:8080/healthz"
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(service.Healthcheck(url))
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "api:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	dbURL := os.Getenv("BETTER_COMPUTE_DATABASE_URL")
	if dbURL == "" {
		return errors.New("BETTER_COMPUTE_DATABASE_URL is not set")
	}
	logger, shutdown, err := telemetry.Setup(ctx, "api")
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
	srv, err := api.New(api.ConfigFromEnv(), api.Deps{DB: db, Logger: logger})
	if err != nil {
		return err
	}
	return srv.Run(ctx)
}
