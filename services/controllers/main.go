// Command controllers runs better-compute's reconcilers: the outbox relay and
// the acceptance reconciler (see package controllers).
//
// Environment: BETTER_COMPUTE_DATABASE_URL (required), BETTER_COMPUTE_NATS_URL
// (nats://127.0.0.1:4222), BC_LISTEN (:8084, serves GET /healthz),
// BC_ACCEPTANCE_TIMEOUT (2m), BC_RECONCILE_INTERVAL (2s), BC_EXPIRY_INTERVAL
// (1s), BC_USAGE_INTERVAL (1m), BC_LIVENESS_TIMEOUT (30s), BC_LIVENESS_INTERVAL (1s),
// BC_LEASE_TTL (15s),
// BC_LEASE_HOLDER (<hostname>-<random>), BC_SIGNED_INTENT (false; true signs
// every command and NodeSpec with BC_PKI_DIR/command-signing.key), BC_PKI_DIR
// (/var/lib/better-compute/pki).
//
// `controllers healthcheck [URL]` GETs URL (http://127.0.0.1:8084/healthz by
// default) and exits 0 when it answers 200.
package main

import (
	"fmt"
	"os"
	"strconv"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

func main() {
	cfg := controllers.Config{
		Listen: service.Env("BC_LISTEN", controllers.DefaultListen),
		Holder: os.Getenv("BC_LEASE_HOLDER"),
		PKIDir: service.Env("BC_PKI_DIR", controllers.DefaultPKIDir),
	}
	service.Main(service.MainOptions{
		Name: "controllers", HealthListen: cfg.Listen, NeedDB: true, NeedNATS: true,
		Run: func(p *service.Process) error {
			if err := service.PositiveDurations(map[string]service.DurationVar{
				"BC_ACCEPTANCE_TIMEOUT": {Dst: &cfg.AcceptanceTimeout, Default: controllers.DefaultAcceptanceTimeout},
				"BC_RECONCILE_INTERVAL": {Dst: &cfg.ReconcileInterval, Default: controllers.DefaultReconcileInterval},
				"BC_LEASE_TTL":          {Dst: &cfg.LeaseTTL, Default: controllers.DefaultLeaseTTL},
				"BC_EXPIRY_INTERVAL":    {Dst: &cfg.ExpiryInterval, Default: controllers.DefaultExpiryInterval},
				"BC_USAGE_INTERVAL":     {Dst: &cfg.UsageInterval, Default: controllers.DefaultUsageInterval},
				"BC_LIVENESS_TIMEOUT":   {Dst: &cfg.LivenessTimeout, Default: controllers.DefaultLivenessTimeout},
				"BC_LIVENESS_INTERVAL":  {Dst: &cfg.LivenessInterval, Default: controllers.DefaultLivenessInterval},
			}); err != nil {
				return err
			}
			signed, err := strconv.ParseBool(service.Env("BC_SIGNED_INTENT", "false"))
			if err != nil {
				return fmt.Errorf("BC_SIGNED_INTENT: want true or false: %w", err)
			}
			cfg.SignedIntent = signed
			srv, err := controllers.New(cfg, controllers.Deps{DB: p.DB, NC: p.NC, Logger: p.Logger, Clock: p.Clock})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
