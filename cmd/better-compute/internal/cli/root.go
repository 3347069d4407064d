// Package cli is the better-compute command line. Each command lives in a
// file of its own (nodes.go, pools.go, …) as a method of app that returns a
// *cobra.Command; NewRoot registers them. To add a command (dev, sim, …),
// write its file and add it to the list in NewRoot.
//
// Global configuration comes from the environment and flags: BETTER_COMPUTE_URL
// (--url, default http://127.0.0.1:8080), BETTER_COMPUTE_TOKEN (--token) and
// BETTER_COMPUTE_TENANT (sent as the X-BC-Tenant header); with
// OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) set, API commands export
// their spans over OTLP (trace.go). Errors are printed
// as "error: <code>: <message>" for API errors and "error: <message>"
// otherwise, and make the process exit 1 — except in console and ssh-proxy,
// which exit 255 when the tunnel fails, as ssh does, so that their other
// statuses are the remote shell's.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"unicode"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/clock"
)

// Env is the world a CLI run sees, so that tests can run it in-process.
type Env struct {
	// Stdin is what console and ssh-proxy send to the node (nil reads as
	// empty). A terminal (an *os.File on one) makes console put it in raw
	// mode and follow its size.
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// Getenv reads an environment variable ("" when unset).
	Getenv func(string) string
	// Clock tells the time for relative times ("3s ago").
	Clock clock.Clock
}

// OSEnv is the process's own environment.
func OSEnv() Env {
	return Env{Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr, Getenv: os.Getenv, Clock: clock.New()}
}

// app holds the global flags and the environment of one run.
type app struct {
	env   Env
	url   string
	token string
	// cmdPath is the command that runs ("better-compute reserve"), trace
	// its tracing once an API client is made (trace.go).
	cmdPath string
	trace   *cliTracing
	// fieldsOf are the commands' flags by the request field they set
	// (apiwords.go).
	fieldsOf map[*cobra.Command]map[string]string
}

// NewRoot returns the root command with every subcommand.
func NewRoot(env Env) *cobra.Command {
	root, _ := newRoot(env)
	return root
}

// newRoot is NewRoot, with the run's app.
func newRoot(env Env) (*cobra.Command, *app) {
	a := &app{env: env}
	root := &cobra.Command{
		Use:           "better-compute",
		Short:         "Operate a better-compute GPU fleet",
		Long:          "better-compute talks to a better-compute control plane (nodes, pools and their offers,\nreservations, usage, sites, join tokens, tenants, API tokens, audit, events), opens machines' consoles\nand SSH connections through tunnels (console, ssh-cert, ssh-proxy), administers a deployment (migrate,\npki, bootstrap) and runs the deterministic fleet simulator (sim).",
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRun: func(cmd *cobra.Command, _ []string) {
			a.cmdPath = cmd.CommandPath()
		},
	}
	root.SetOut(env.Stdout)
	root.SetErr(env.Stderr)
	root.PersistentFlags().StringVar(&a.url, "url", "", "API base URL (env BETTER_COMPUTE_URL, default "+defaultURL+")")
	root.PersistentFlags().StringVar(&a.token, "token", "", "API token (env BETTER_COMPUTE_TOKEN)")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return fmt.Errorf("%w (see '%s --help')", err, c.CommandPath())
	})
	root.AddCommand(
		a.nodesCmd(),
		a.poolsCmd(),
		a.reserveCmd(),
		a.releaseCmd(),
		a.reservationsCmd(),
		a.commandsCmd(),
		a.consoleCmd(),
		a.sshCertCmd(),
		a.sshProxyCmd(),
		a.usageCmd(),
		a.sitesCmd(),
		a.joinTokensCmd(),
		a.tenantsCmd(),
		a.tokensCmd(),
		a.auditCmd(),
		a.eventsCmd(),
		a.devCmd(),
		a.simCmd(),
		a.migrateCmd(),
		a.pkiCmd(),
		a.bootstrapCmd(),
		a.healthcheckCmd(),
		a.lbCmd(),
		a.versionCmd(),
	)
	root.InitDefaultCompletionCmd()
	refuseUnknownSubcommands(root)
	showIsGet(root)
	return root, a
}

// showIsGet makes "show" an alias of every "get" subcommand (`reservations
// show ID` is `reservations get ID`): cobra's help lists it under Aliases,
// and the group completes it beside its subcommands, described as the
// alias it is (cobra completes subcommands by name only).
func showIsGet(c *cobra.Command) {
	for _, sub := range c.Commands() {
		showIsGet(sub)
		if sub.Name() != "get" || sub.HasAlias("show") {
			continue
		}
		sub.Aliases = append(sub.Aliases, "show")
		c.ValidArgs = append(c.ValidArgs, cobra.CompletionWithDesc("show", "alias of get: "+sub.Short))
	}
}

// refuseUnknownSubcommands makes every group command (one with subcommands
// and no action of its own) fail on an unknown subcommand, instead of
// cobra's default of printing help and exiting 0. Without arguments it still
// prints its help.
func refuseUnknownSubcommands(c *cobra.Command) {
	for _, sub := range c.Commands() {
		refuseUnknownSubcommands(sub)
	}
	if c == c.Root() || !c.HasSubCommands() || c.Runnable() {
		return
	}
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return cmd.Help()
		}
		return fmt.Errorf("unknown command %q for %q (see '%s --help')", args[0], cmd.CommandPath(), cmd.CommandPath())
	}
}

// exitError ends a run with a status code and no message of its own (the
// command printed what it had to say).
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// Run runs the CLI with args (without the program name) and returns the
// process exit code, after exporting the run's spans when tracing is on
// (trace.go).
func Run(ctx context.Context, args []string, env Env) int {
	root, a := newRoot(env)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	a.trace.end()
	err = a.inFlagWords(cmd, err)
	if err == nil {
		return 0
	}
	var ee exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	fmt.Fprintln(env.Stderr, FormatError(err))
	return 1
}

// FormatError renders err for the terminal: "error: <code>: <message>" for
// API (Connect) errors, the patterns of the API's rules in words
// (describeRules), with every control character escaped (cell: the
// server's text may quote what a machine or another caller sent);
// "error: <message>" otherwise, the CLI's own text (a usage error, "Did you
// mean this?"), whose lines and tabs are kept and other control characters
// escaped, without trailing newlines.
func FormatError(err error) string {
	var cerr *connect.Error
	if errors.As(err, &cerr) {
		return fmt.Sprintf("error: %s: %s", cerr.Code(), cell(describeRules(cerr.Message())))
	}
	return "error: " + keepLines(strings.TrimRight(err.Error(), "\n"))
}

// keepLines is s with each control character but newline and tab escaped,
// as in a Go string literal.
func keepLines(s string) string {
	var b strings.Builder
	for _, r := range s {
		if r == '\n' || r == '\t' || !unicode.IsControl(r) {
			b.WriteRune(r)
			continue
		}
		q := strconv.QuoteRune(r)
		b.WriteString(q[1 : len(q)-1])
	}
	return b.String()
}
