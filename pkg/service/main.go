package service

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Config is what Main needs of a service's configuration struct besides its
// variables (pkg/config): where the service answers GET /healthz and GET
// /readyz, for `NAME healthcheck` without a URL.
type Config interface {
	ProbeAddr() string
}

// Main is the whole main function of a service binary, given its name and
// its constructor: `NAME healthcheck [URL]` for container health checks
// (URL defaults to the loopback /readyz of the configuration's ProbeAddr,
// https when C embeds TLS with its files set); otherwise it reads C from
// the environment (config.Load), takes a context that SIGINT and SIGTERM
// end, sets up telemetry (telemetry.Setup, and telemetry.SetupMetrics: an
// unknown BETTER_COMPUTE_METRICS_EXPORTER stops it here, naming the
// variable), starts the profiling server when BETTER_COMPUTE_PPROF_LISTEN
// is set (Profiling), opens the database when C embeds Database (waiting up to a
// minute for it; its pools' statistics are exported, DB.RecordPoolStats)
// and NATS when C embeds NATS, calls newService and
// runs what it returns until the signal. It exits 1 with "NAME: error" on
// standard error (a line per error) when any of that fails, and never
// returns.
func Main[C Config, R Runner](name string, newService func(C, Deps) (R, error)) {
	var cfg C
	cfgErr := config.Load(&cfg, os.Getenv)
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := ProbeURL(cfg.ProbeAddr())
		if t, ok := any(cfg).(interface{ servesTLS() bool }); ok && t.servesTLS() {
			url = "https" + strings.TrimPrefix(url, "http")
		}
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(Healthcheck(url))
	}
	err := cfgErr
	if err == nil {
		err = runMain(name, cfg, newService)
	}
	if err != nil {
		for line := range strings.Lines(err.Error()) {
			fmt.Fprintf(os.Stderr, "%s: %s", name, strings.TrimSuffix(line, "\n")+"\n")
		}
		os.Exit(1)
	}
	os.Exit(0)
}

func runMain[C Config, R Runner](name string, cfg C, newService func(C, Deps) (R, error)) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger, shutdownTracing, err := telemetry.Setup(ctx, name)
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdownTracing(sctx)
	}()
	var prof Profiling
	if err := config.Load(&prof, os.Getenv); err != nil {
		return err
	}
	stopProfiling, err := StartProfiling(prof, logger)
	if err != nil {
		return err
	}
	defer stopProfiling()
	metrics, err := telemetry.SetupMetrics(ctx, name, os.Getenv)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = metrics.Shutdown(sctx)
	}()
	deps := Deps{Logger: logger, Clock: clock.New(), Metrics: metrics}
	if db, ok := any(cfg).(interface{ databaseURL() string }); ok {
		url := db.databaseURL()
		if url == "" {
			return errors.New(config.Prefix + "DATABASE_URL is required")
		}
		if deps.DB, err = store.Open(ctx, url, deps.Clock, time.Minute, store.Options{}); err != nil {
			return err
		}
		defer deps.DB.Close()
		if err := deps.DB.RecordPoolStats(metrics.Provider); err != nil {
			return err
		}
	}
	if n, ok := any(cfg).(interface{ natsURL() string }); ok {
		if deps.NC, err = bus.Connect(n.natsURL(), name, logger); err != nil {
			return err
		}
		defer deps.NC.Close()
		if deps.DB != nil {
			deps.DB.SignalOutboxVia(func() error { return deps.NC.Publish(store.SubjectOutboxWritten, nil) })
			deps.DB.PokeVia(bus.PublishWithID(deps.NC, store.OutboxIDHeader))
		}
	}
	svc, err := newService(cfg, deps)
	if err != nil {
		return err
	}
	return svc.Run(ctx)
}

// ProbeURL turns a listen address (":8083") into the loopback URL of its
// GET /readyz.
func ProbeURL(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "http://127.0.0.1/readyz"
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/readyz"
}
