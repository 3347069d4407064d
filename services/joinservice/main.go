// Command joinservice serves bc.join.v1.JoinService: sealed join tokens and
// CSRs in, signed JoinResponses with node certificates out. Configuration is
// the environment: BETTER_COMPUTE_DATABASE_URL, BC_LISTEN (:8081),
// BC_PKI_DIR (/var/lib/better-compute/pki: the node CA, serving-ca.crt,
// join-encryption.key, join-signing.key, command-signing.pub),
// BC_NODE_CERT_TTL (24h), BC_GATEWAY_URL (https://gateway:8443),
// BC_GATEWAY_SERVER_NAME (gateway), BC_TRUST_DOMAIN (from the PKI directory),
// BC_SIGNED_INTENT (false; true sends the command-signing root to joining
// nodes). `joinservice healthcheck [URL]` probes /healthz.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

func main() {
	cfg, cfgErr := joinservice.ConfigFromEnv()
	service.Main(service.MainOptions{
		Name: "joinservice", HealthListen: cfg.Listen, NeedDB: true,
		Run: func(p *service.Process) error {
			if cfgErr != nil {
				return cfgErr
			}
			srv, err := joinservice.New(cfg, joinservice.Deps{DB: p.DB, Logger: p.Logger})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
