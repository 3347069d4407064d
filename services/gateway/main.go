// Command gateway serves the daemons' Session streams over HTTP/2 with mutual
// TLS (see package gateway).
//
// Environment: BETTER_COMPUTE_DATABASE_URL (required), BETTER_COMPUTE_NATS_URL
// (nats://127.0.0.1:4222), BC_PKI_DIR (/var/lib/better-compute/pki),
// BC_LISTEN (:8443), BC_HEALTH_LISTEN (:8082), BC_GATEWAY_ID (gw-<hostname>),
// BC_HEARTBEAT_INTERVAL (10s), BC_GATEWAY_RESYNC (5s),
// BC_GATEWAY_FLUSH_INTERVAL (1s), BC_GATEWAY_IDLE_TIMEOUT (3 × heartbeat),
// BC_NODE_CERT_TTL (24h, the lifetime of renewed node certificates).
//
// `gateway healthcheck [URL]` GETs URL (http://127.0.0.1:8082/healthz by
// default) and exits 0 when it answers 200.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

func main() {
	cfg := gateway.Config{
		GatewayID:    service.Env("BC_GATEWAY_ID", gateway.DefaultGatewayID()),
		Listen:       service.Env("BC_LISTEN", gateway.DefaultListen),
		HealthListen: service.Env("BC_HEALTH_LISTEN", gateway.DefaultHealthListen),
		PKIDir:       service.Env("BC_PKI_DIR", gateway.DefaultPKIDir),
	}
	service.Main(service.MainOptions{
		Name: "gateway", HealthListen: cfg.HealthListen, NeedDB: true, NeedNATS: true,
		Run: func(p *service.Process) error {
			if err := service.PositiveDurations(map[string]service.DurationVar{
				"BC_HEARTBEAT_INTERVAL":     {Dst: &cfg.HeartbeatInterval, Default: gateway.DefaultHeartbeatInterval},
				"BC_GATEWAY_RESYNC":         {Dst: &cfg.ResyncInterval, Default: gateway.DefaultResyncInterval},
				"BC_GATEWAY_FLUSH_INTERVAL": {Dst: &cfg.FlushInterval, Default: gateway.DefaultFlushInterval},
				"BC_NODE_CERT_TTL":          {Dst: &cfg.NodeCertTTL, Default: gateway.DefaultNodeCertTTL},
			}); err != nil {
				return err
			}
			// 0 (unset) means 3 × the heartbeat interval.
			idle, err := service.EnvDuration("BC_GATEWAY_IDLE_TIMEOUT", 0)
			if err != nil {
				return err
			}
			cfg.IdleTimeout = idle
			srv, err := gateway.New(cfg, gateway.Deps{DB: p.DB, NC: p.NC, Logger: p.Logger, Clock: p.Clock})
			if err != nil {
				return err
			}
			return srv.Run(p.Ctx)
		},
	})
}
