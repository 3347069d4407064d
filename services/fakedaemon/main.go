// Command fakedaemon runs simulated GPU machines that join better-compute and
// hold a Session with the gateway, as the real daemon does, on fake hardware.
//
// Flags (each with an environment variable that sets its default):
//
//	--join-url URL             BC_JOIN_URL             JoinService (http://joinservice:8081)
//	--token-file PATH          BC_JOIN_TOKEN_FILE      file holding the join token, waited for
//	                           BC_JOIN_TOKEN           the join token itself (wins over the file)
//	--token-wait DURATION      BC_JOIN_TOKEN_WAIT      how long to wait for the token file (2m)
//	--data-dir PATH            BC_DATA_DIR             identities and journals (/var/lib/fakedaemon)
//	--variant NAME             BC_VARIANT              hgx-h100, hgx-h100-gpu-missing, l40s, cpu (hgx-h100)
//	--nodes N                  BC_NODES                machines in this process, each in <data-dir>/<i> (1)
//	--gateway-url URL          BC_GATEWAY_URL          overrides the JoinResponse's gateway URL
//	--gateway-server-name NAME BC_GATEWAY_SERVER_NAME  overrides the TLS server name of the gateway
//	--health-listen ADDR       BC_HEALTH_LISTEN        /healthz server (:8085; --health-listen= for none)
//
// `fakedaemon healthcheck [URL]` probes http://127.0.0.1:8085/healthz, which
// answers 200 once every machine has joined. A refused Join (bad, expired,
// revoked or used-up token) exits with status 1 and the server's reason.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		url := "http://127.0.0.1:8085/healthz"
		if len(os.Args) > 2 {
			url = os.Args[2]
		}
		os.Exit(service.Healthcheck(url))
	}
	cfg, err := parseConfig(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakedaemon:", err)
		os.Exit(2)
	}
	if err := run(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "fakedaemon:", err)
		os.Exit(1)
	}
}

// parseConfig reads flags whose defaults come from the environment.
func parseConfig(args []string) (fakedaemon.Config, error) {
	var cfg fakedaemon.Config
	fs := flag.NewFlagSet("fakedaemon", flag.ContinueOnError)
	tokenWait, err := service.EnvDuration("BC_JOIN_TOKEN_WAIT", fakedaemon.DefaultTokenWait)
	if err != nil {
		return cfg, err
	}
	nodes := 1
	if v := os.Getenv("BC_NODES"); v != "" {
		if nodes, err = strconv.Atoi(v); err != nil {
			return cfg, fmt.Errorf("BC_NODES: %w", err)
		}
	}
	fs.StringVar(&cfg.JoinURL, "join-url", service.Env("BC_JOIN_URL", fakedaemon.DefaultJoinURL), "JoinService base URL")
	fs.StringVar(&cfg.TokenFile, "token-file", os.Getenv("BC_JOIN_TOKEN_FILE"), "file holding the join token (waited for)")
	fs.DurationVar(&cfg.TokenWait, "token-wait", tokenWait, "how long to wait for the token file to appear")
	fs.StringVar(&cfg.DataDir, "data-dir", service.Env("BC_DATA_DIR", fakedaemon.DefaultDataDir), "directory of the machines' identities and journals")
	fs.StringVar(&cfg.Variant, "variant", service.Env("BC_VARIANT", fakedaemon.DefaultVariant), "fake hardware: hgx-h100, hgx-h100-gpu-missing, l40s or cpu")
	fs.IntVar(&cfg.Nodes, "nodes", nodes, "machines to run in this process")
	fs.StringVar(&cfg.GatewayURL, "gateway-url", os.Getenv("BC_GATEWAY_URL"), "override the gateway URL of the JoinResponse")
	fs.StringVar(&cfg.GatewayServerName, "gateway-server-name", os.Getenv("BC_GATEWAY_SERVER_NAME"), "override the gateway's TLS server name")
	fs.StringVar(&cfg.HealthListen, "health-listen", service.Env("BC_HEALTH_LISTEN", fakedaemon.DefaultHealthListen), "address of the /healthz server (empty for none)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if cfg.Nodes < 1 {
		return cfg, fmt.Errorf("--nodes must be at least 1, got %d", cfg.Nodes)
	}
	cfg.Token = os.Getenv("BC_JOIN_TOKEN")
	return cfg, nil
}

func run(cfg fakedaemon.Config) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger, shutdown, err := telemetry.Setup(ctx, "fakedaemon")
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdown(sctx)
	}()
	r, err := fakedaemon.New(cfg, fakedaemon.Deps{Logger: logger})
	if err != nil {
		return err
	}
	return r.Run(ctx)
}
