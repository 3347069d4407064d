// Command api serves better-compute's public Connect API under /api/compute
// and GET /healthz. Configuration is the environment:
// BETTER_COMPUTE_DATABASE_URL and BC_LISTEN (:8080). `api healthcheck [URL]`
// probes /healthz.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/api/api"
)

func main() {
	cfg := api.ConfigFromEnv()
	service.Main(service.MainOptions{
		Name: "api", HealthListen: cfg.Listen, NeedDB: true,
		Run: func(p *service.Process) error {
			srv, err := api.New(cfg, api.Deps{DB: p.DB, Logger: p.Logger})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
