// Command joinservice serves bc.join.v1.JoinService: sealed join tokens and
// CSRs in, signed JoinResponses with node certificates out (see package
// joinservice). Its configuration is the environment (joinservice.Config;
// docs/configuration.md). `joinservice healthcheck [URL]` probes /readyz.
package main

import (
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

func main() { service.Main(joinservice.Name, joinservice.New) }
