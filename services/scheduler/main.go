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
	"os"

	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

func main() {
	cfg := scheduler.Config{
		Listen: service.Env("BC_LISTEN", scheduler.DefaultListen),
		Holder: os.Getenv("BC_LEASE_HOLDER"),
	}
	service.Main(service.MainOptions{
		Name: "scheduler", HealthListen: cfg.Listen, NeedDB: true, NeedNATS: true,
		Run: func(p *service.Process) error {
			if err := service.PositiveDurations(map[string]service.DurationVar{
				"BC_SCHEDULE_INTERVAL": {Dst: &cfg.Interval, Default: scheduler.DefaultInterval},
				"BC_LEASE_TTL":         {Dst: &cfg.LeaseTTL, Default: scheduler.DefaultLeaseTTL},
			}); err != nil {
				return err
			}
			srv, err := scheduler.New(cfg, scheduler.Deps{DB: p.DB, NC: p.NC, Logger: p.Logger, Clock: p.Clock})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
