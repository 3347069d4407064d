// Command bc-healthcheck GETs a URL and exits 0 when it answers 200 OK. It is
// the compose health check of images that have no shell (NATS on scratch).
//
// Usage: bc-healthcheck URL
package main

import (
	"fmt"
	"os"

	"github.com/better-compute/better-compute/pkg/service"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: bc-healthcheck URL")
		os.Exit(2)
	}
	os.Exit(service.Healthcheck(os.Args[1]))
}
