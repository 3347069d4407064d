// Command api serves better-compute's public Connect API under /api/compute,
// the events watch, GET /.well-known/better-compute and the probes (see
// package api). Its configuration is the environment (api.Config;
// docs/configuration.md). `api healthcheck [URL]` probes /readyz.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/api/api"
)

func main() { service.Main(api.Name, api.New) }
