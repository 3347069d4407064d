// Command scheduler places pending reservations onto devices while it holds
// the scheduler lease, and serves its probes (see package scheduler). Its
// configuration is the environment (scheduler.Config;
// docs/configuration.md). `scheduler healthcheck [URL]` probes /readyz
// (http://127.0.0.1:8083/readyz by default) and exits 0 when it answers 200.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

func main() { service.Main(scheduler.Name, scheduler.New) }
