package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/better-compute/better-compute/pkg/config"
)

// Profiling is the opt-in profiling server of every service binary (Main):
// Go's runtime profiles, as net/http/pprof serves them, on an address of
// their own, apart from every listener that callers or machines reach.
type Profiling struct {
	// PprofListen is the address of a plain-HTTP server of Go's runtime
	// profiles (GET /debug/pprof/, e.g. /debug/pprof/profile?seconds=30 for
	// CPU, /debug/pprof/heap, /debug/pprof/goroutine; `go tool pprof URL`
	// reads them). Unset: no such server. Profiles expose the process's
	// internals and cost CPU while taken: bind it to loopback or a private
	// network only. A busy address stops the service at start.
	PprofListen string `env:"PPROF_LISTEN"`
}

// pprofHandler serves net/http/pprof's handlers under /debug/pprof/.
func pprofHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// StartProfiling starts p's server when PprofListen is set and returns the
// function that stops it; it fails, naming BETTER_COMPUTE_PPROF_LISTEN,
// when the address cannot be bound. Main calls it for every service; the
// fakedaemon for its --pprof-listen.
func StartProfiling(p Profiling, log *slog.Logger) (stop func(), err error) {
	if p.PprofListen == "" {
		return func() {}, nil
	}
	ln, err := Listen(p.PprofListen)
	if err != nil {
		return nil, &config.Error{Name: config.Prefix + "PPROF_LISTEN", Err: err}
	}
	// No write timeout: a CPU profile or trace streams for as long as asked.
	srv := &http.Server{Handler: pprofHandler(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("profiling server", "err", err)
		}
	}()
	log.Info(fmt.Sprintf("profiling server on http://%s/debug/pprof/", ln.Addr()))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}
