package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/lb"
)

func (a *app) lbCmd() *cobra.Command {
	var listen, backend, health string
	var interval time.Duration
	c := &cobra.Command{
		Use:   "lb --listen ADDR --backend HOST:PORT",
		Short: "Spread TCP connections over the replicas a host name resolves to (compose's API entry)",
		Long: "lb accepts TCP connections on --listen and splices each, unchanged, to one of the addresses\n" +
			"--backend's host resolves to (docker's DNS answers a compose service's name with each replica's\n" +
			"address), round robin, skipping an address that refuses the connection. It resolves the name again\n" +
			"every --resolve-every. Being TCP, it carries HTTP/1.1, h2c (Connect streams), NDJSON watches and\n" +
			"WebSocket tunnels as they are; a connection stays on one replica. --health-listen serves /healthz and\n" +
			"/readyz (ready once an address is known) for `better-compute healthcheck URL`. It runs until\n" +
			"interrupted.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&listen, "listen", ":8080", "address to accept connections on")
	c.Flags().StringVar(&backend, "backend", "", "host:port of the replicas (required)")
	c.Flags().StringVar(&health, "health-listen", "", "address of the /healthz and /readyz server (none if empty)")
	c.Flags().DurationVar(&interval, "resolve-every", lb.DefaultInterval, "how often the backend's host is resolved again")
	_ = c.MarkFlagRequired("backend")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if _, _, err := net.SplitHostPort(backend); err != nil {
			return fmt.Errorf("--backend %q: want host:port: %w", backend, err)
		}
		if interval <= 0 {
			return fmt.Errorf("--resolve-every %s: must be positive", interval)
		}
		log := slog.New(slog.NewTextHandler(a.env.Stderr, nil)).With("component", "lb")
		bal := &lb.Balancer{Backend: backend, Interval: interval, Logger: log}
		ln, err := net.Listen("tcp", listen)
		if err != nil {
			return fmt.Errorf("--listen: %w", err)
		}
		ctx, cancel := context.WithCancel(cmd.Context())
		defer cancel()
		if health != "" {
			hln, err := net.Listen("tcp", health)
			if err != nil {
				_ = ln.Close()
				return fmt.Errorf("--health-listen: %w", err)
			}
			srv := &http.Server{Handler: bal.HealthHandler(), ReadHeaderTimeout: 5 * time.Second}
			go func() {
				<-ctx.Done()
				_ = srv.Close()
			}()
			go func() {
				if err := srv.Serve(hln); err != nil && !errors.Is(err, http.ErrServerClosed) {
					log.Error("health server", "error", err)
					cancel()
				}
			}()
		}
		log.Info("listening", "listen", ln.Addr().String(), "backend", backend)
		return bal.Serve(ctx, ln)
	}
	return c
}
