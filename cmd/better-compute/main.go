// Command better-compute is the CLI of better-compute: it talks to the API
// (nodes, pools, sites, join tokens) and administers a deployment (migrate,
// pki, bootstrap). See internal/cli for the commands and their environment.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
)

func main() {
	// SIGHUP (the terminal closed) ends a run as Ctrl-C does, so `dev` and
	// `events watch` clean up.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	code := cli.Run(ctx, os.Args[1:], cli.OSEnv())
	stop()
	os.Exit(code)
}
