package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Process is what Main hands a service's run function: a context ended by
// SIGINT or SIGTERM, the logger, the clock, and the connections the service
// asked for (nil otherwise).
type Process struct {
	Ctx    context.Context
	Logger *slog.Logger
	Clock  clock.Clock
	// DB is open when MainOptions.NeedDB; from BETTER_COMPUTE_DATABASE_URL.
	DB *store.DB
	// NC is connected when MainOptions.NeedNATS; from
	// BETTER_COMPUTE_NATS_URL (default nats://127.0.0.1:4222).
	NC *nats.Conn
}

// MainOptions describe a service binary for Main.
type MainOptions struct {
	// Name is the service's name in logs, traces and error messages.
	Name string
	// HealthListen is the address of the service's /healthz server (e.g.
	// BC_LISTEN's value); `NAME healthcheck` without a URL GETs it on
	// loopback.
	HealthListen string
	// NeedDB opens the database (waiting up to a minute for it).
	NeedDB bool
	// NeedNATS connects to NATS.
	NeedNATS bool
	// Run runs the service until p.Ctx ends.
	Run func(p *Process) error
}

// Main is the whole main function of a service binary: `NAME healthcheck
// [URL]` for container health checks, otherwise telemetry, a signal context,
// the database and NATS, then o.Run. It exits 1 with "NAME: error" on
// standard error when the service fails, and never returns.
func Main(o MainOptions) {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := HealthURL(o.HealthListen)
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(Healthcheck(url))
	}
	if err := runMain(o); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", o.Name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runMain(o MainOptions) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger, shutdownTracing, err := telemetry.Setup(ctx, o.Name)
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdownTracing(sctx)
	}()
	p := &Process{Ctx: ctx, Logger: logger, Clock: clock.New()}
	if o.NeedDB {
		url := os.Getenv("BETTER_COMPUTE_DATABASE_URL")
		if url == "" {
			return errors.New("BETTER_COMPUTE_DATABASE_URL is required")
		}
		if p.DB, err = store.Open(ctx, url, p.Clock, time.Minute, store.Options{}); err != nil {
			return err
		}
		defer p.DB.Close()
	}
	if o.NeedNATS {
		if p.NC, err = bus.Connect(Env("BETTER_COMPUTE_NATS_URL", nats.DefaultURL), o.Name, logger); err != nil {
			return err
		}
		defer p.NC.Close()
		if p.DB != nil {
			p.DB.SignalOutboxVia(func() error { return p.NC.Publish(store.SubjectOutboxWritten, nil) })
		}
	}
	return o.Run(p)
}

// HealthURL turns a listen address (":8083") into the loopback URL of its
// /healthz.
func HealthURL(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "http://127.0.0.1/healthz"
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/healthz"
}

// PositiveDurations reads each key as a Go duration (default when unset)
// into its destination; it fails, naming the key, on a malformed or
// non-positive value.
func PositiveDurations(vars map[string]DurationVar) error {
	for key, v := range vars {
		d, err := EnvDuration(key, v.Default)
		if err != nil {
			return err
		}
		if d <= 0 {
			return fmt.Errorf("%s must be positive", key)
		}
		*v.Dst = d
	}
	return nil
}

// DurationVar is one duration read by PositiveDurations.
type DurationVar struct {
	Dst     *time.Duration
	Default time.Duration
}
