// Command scheduler places pending reservations onto devices (see package
// scheduler) while it holds the scheduler lease.
//
// Environment: BETTER_COMPUTE_DATABASE_URL (required), BETTER_COMPUTE_NATS_URL
// (nats://127.0.0.1:4222), BC_LISTEN (:8083, serves GET /healthz),
// BC_SCHEDULE_INTERVAL (2s), BC_LEASE_TTL (15s), BC_LEASE_HOLDER
// (<hostname>-<random>), BC_STARVATION_BOUND (5m), BC_SIGNED_INTENT (false;
// true signs every NodeSpec with BC_PKI_DIR/command-signing.key), BC_PKI_DIR
// (/var/lib/better-compute/pki).
//
// `scheduler healthcheck [URL]` GETs URL (http://127.0.0.1:8083/healthz by
// default) and exits 0 when it answers 200.
package main

import (
	"fmt"
	"os"
	"strconv"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

func main() {
	cfg := scheduler.Config{
		Listen: service.Env("BC_LISTEN", scheduler.DefaultListen),
		Holder: os.Getenv("BC_LEASE_HOLDER"),
		PKIDir: service.Env("BC_PKI_DIR", scheduler.DefaultPKIDir),
	}
	service.Main(service.MainOptions{
		Name: "scheduler", HealthListen: cfg.Listen, NeedDB: true, NeedNATS: true,
		Run: func(p *service.Process) error {
			if err := service.PositiveDurations(map[string]service.DurationVar{
				"BC_SCHEDULE_INTERVAL": {Dst: &cfg.Interval, Default: scheduler.DefaultInterval},
				"BC_LEASE_TTL":         {Dst: &cfg.LeaseTTL, Default: scheduler.DefaultLeaseTTL},
				"BC_STARVATION_BOUND":  {Dst: &cfg.StarvationBound, Default: scheduler.DefaultStarvationBound},
			}); err != nil {
				return err
			}
			signed, err := strconv.ParseBool(service.Env("BC_SIGNED_INTENT", "false"))
			if err != nil {
				return fmt.Errorf("BC_SIGNED_INTENT: want true or false: %w", err)
			}
			cfg.SignedIntent = signed
			srv, err := scheduler.New(cfg, scheduler.Deps{DB: p.DB, NC: p.NC, Logger: p.Logger, Clock: p.Clock})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
