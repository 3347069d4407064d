// Command api serves better-compute's public Connect API under /api/compute,
// GET /healthz and GET /.well-known/better-compute. Configuration is the
// environment: BETTER_COMPUTE_DATABASE_URL, BC_LISTEN (:8080) and, for the
// well-known document, BC_PKI_DIR (its public files; unset: not served),
// BC_PUBLIC_URL (baseUrl; unset: from the request), BC_JOIN_URL,
// BC_GATEWAY_URL and BC_GATEWAY_SERVER_NAME; BC_SIGNED_INTENT (false; true
// signs the NodeSpecs a release changes with BC_PKI_DIR/command-signing.key);
// BETTER_COMPUTE_NATS_URL (nats://127.0.0.1:4222) wakes event watches as
// soon as an event is published (without NATS they poll the table) and
// carries API token revocations from the other API servers;
// BC_TOKEN_CACHE_TTL (unset or 0: 1s; negative: no cache) is how long a
// valid API token's row is trusted without a query, the longest a token
// revoked on another server keeps working here when its NATS message is
// lost.
// `api healthcheck [URL]` probes /healthz.
package main

import (
	"fmt"
	"strconv"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/api/api"
)

func main() {
	cfg := api.ConfigFromEnv()
	service.Main(service.MainOptions{
		Name: "api", HealthListen: cfg.Listen, NeedDB: true, NeedNATS: true,
		Run: func(p *service.Process) error {
			signed, err := strconv.ParseBool(service.Env("BC_SIGNED_INTENT", "false"))
			if err != nil {
				return fmt.Errorf("BC_SIGNED_INTENT: want true or false: %w", err)
			}
			cfg.SignedIntent = signed
			if cfg.TokenCacheTTL, err = service.EnvDuration("BC_TOKEN_CACHE_TTL", 0); err != nil {
				return err
			}
			srv, err := api.New(cfg, api.Deps{DB: p.DB, Logger: p.Logger, NC: p.NC})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
