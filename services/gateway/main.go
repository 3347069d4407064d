// Command gateway serves the daemons' Session and Tunnel streams over HTTP/2
// with mutual TLS, the API's tunnels on its control server (h2c), and its
// probes on a plain HTTP server (see package gateway). Its
// configuration is the environment (gateway.Config;
// docs/configuration.md). `gateway healthcheck [URL]` probes /readyz
// (http://127.0.0.1:8082/readyz by default) and exits 0 when it answers 200.
// The binary sets its garbage collector's target (gateway.NewProcess,
// GATEWAY_GC_PERCENT).
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

func main() { service.Main(gateway.Name, gateway.NewProcess) }
