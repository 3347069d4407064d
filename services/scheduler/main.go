// Command scheduler will place reservations onto devices; placement is not
// implemented yet (see package scheduler): today it holds the scheduler lease
// and runs an empty loop.
//
// Environment: BETTER_COMPUTE_DATABASE_URL (required), BETTER_COMPUTE_NATS_URL
// (nats://127.0.0.1:4222), BC_LISTEN (:8083, serves GET /healthz),
// BC_SCHEDULE_INTERVAL (2s), BC_LEASE_TTL (15s), BC_LEASE_HOLDER
// (<hostname>-<random>).
//
// `scheduler healthcheck [URL]` GETs URL (http://127.0.0.1:8083/healthz by
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
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := healthURL(service.Env("BC_LISTEN", scheduler.DefaultListen))
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(service.Healthcheck(url))
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "scheduler:", err)
		os.Exit(1)
	}
}

// healthURL turns a listen address (":8083") into a loopback URL.
func healthURL(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "http://127.0.0.1:8083/healthz"
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/healthz"
}

// env is the process environment the scheduler reads.
type env struct {
	cfg      scheduler.Config
	database string
	nats     string
}

func readEnv() (env, error) {
	var e env
	e.database = os.Getenv("BETTER_COMPUTE_DATABASE_URL")
	if e.database == "" {
		return env{}, errors.New("BETTER_COMPUTE_DATABASE_URL is required")
	}
	e.nats = service.Env("BETTER_COMPUTE_NATS_URL", nats.DefaultURL)
	e.cfg = scheduler.Config{
		Listen: service.Env("BC_LISTEN", scheduler.DefaultListen),
		Holder: os.Getenv("BC_LEASE_HOLDER"),
	}
	for _, d := range []struct {
		key string
		dst *time.Duration
		def time.Duration
	}{
		{"BC_SCHEDULE_INTERVAL", &e.cfg.Interval, scheduler.DefaultInterval},
		{"BC_LEASE_TTL", &e.cfg.LeaseTTL, scheduler.DefaultLeaseTTL},
	} {
		v, err := service.EnvDuration(d.key, d.def)
		if err != nil {
			return env{}, err
		}
		if v <= 0 {
			return env{}, fmt.Errorf("%s must be positive", d.key)
		}
		*d.dst = v
	}
	return e, nil
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger, shutdownTracing, err := telemetry.Setup(ctx, "scheduler")
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
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
		return err
	}
	defer db.Close()
	nc, err := bus.Connect(e.nats, "scheduler", logger)
	if err != nil {
		return err
	}
	defer nc.Close()
	srv, err := scheduler.New(e.cfg, scheduler.Deps{DB: db, NC: nc, Logger: logger, Clock: clk})
	if err != nil {
		return err
	}
	return srv.Run(ctx)
}
