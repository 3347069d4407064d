// Command controllers runs better-compute's reconcilers: the outbox relay on
// every replica, and acceptance, expiry, command expiry, usage and liveness
// each behind its lease; it serves its probes (see package controllers). Its
// configuration is the environment (controllers.Config;
// docs/configuration.md). `controllers healthcheck [URL]` probes /readyz
// (http://127.0.0.1:8084/readyz by default) and exits 0 when it answers 200.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

func main() { service.Main(controllers.Name, controllers.New) }
