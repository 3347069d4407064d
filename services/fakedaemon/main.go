// Command fakedaemon runs simulated GPU machines that join better-compute and
// hold a Session with the gateway, as the real daemon does, on fake hardware:
// the node agent (pkg/agent) on pkg/fakehw (package fakedaemon).
//
//	fakedaemon [flags]          join (machines that have not yet), then run the sessions
//	fakedaemon join [flags]     join the machines that have not yet, print their node ids, exit
//	fakedaemon healthcheck [URL]
//
// Every flag has an environment variable that sets its default
// (BETTER_COMPUTE_SERVER, BETTER_COMPUTE_PINS_FILE, …): `fakedaemon --help`
// lists them, docs/configuration.md too (generated from them), and
// docs/fakedaemon.md explains them. Package flags defines them and reads
// them into a fakedaemon.Config.
//
// The token is only ever sent sealed to JoinService's key, and a machine
// trusts a JoinResponse only once it verified it against the pins: without
// pins it refuses to join. `fakedaemon healthcheck [URL]` probes
// http://127.0.0.1:8085/healthz, which answers 200 once every machine has
// joined. A refused Join (bad, expired, revoked or used-up token) or an
// untrusted JoinResponse exits with status 1 and the reason; a bad flag or
// variable with status 2.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
	"github.com/better-compute/better-compute/services/fakedaemon/flags"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := execute(ctx, newRoot(run), os.Args[1:], os.Stderr)
	stop()
	os.Exit(code)
}

// runFunc runs the machines of cfg, printing what a `join` run reports to
// out.
type runFunc func(ctx context.Context, cfg fakedaemon.Config, out io.Writer) error

// usageError is a bad flag, argument or environment variable: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// exitError ends a run with a status code and no message of its own.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// execute runs root with args and returns the exit status: 0, 1 for a
// failed run (the error printed to stderr), 2 for a usage error.
func execute(ctx context.Context, root *cobra.Command, args []string, stderr io.Writer) int {
	root.SetArgs(args)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	var ee exitError
	var ue usageError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	case errors.As(err, &ue):
		fmt.Fprintln(stderr, "fakedaemon:", err)
		return 2
	default:
		fmt.Fprintln(stderr, "fakedaemon:", err)
		return 1
	}
}

// newRoot returns the fakedaemon command with its join and healthcheck
// subcommands; the machines run with run.
func newRoot(run runFunc) *cobra.Command {
	root := &cobra.Command{
		Use:   "fakedaemon [flags]",
		Short: "Run simulated GPU machines: join (those that have not yet), then hold their sessions",
		Long: "fakedaemon runs --nodes simulated GPU machines of --variant that join the deployment as the real\n" +
			"daemon does (the join keys from --server's well-known document, checked against the pins), keep their\n" +
			"identities in --data-dir/<index>, and hold a Session with a gateway; /healthz (--health-listen)\n" +
			"answers 200 once every machine has joined. Every flag's default comes from the environment variable\n" +
			"named beside it.",
		Args:          noArgs,
		SilenceErrors: true,
		SilenceUsage:  true,
	}
	root.CompletionOptions.DisableDefaultCmd = true
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usageError{fmt.Errorf("%w (see '%s --help')", err, c.CommandPath())}
	})
	machines := func(c *cobra.Command, joinOnly bool) {
		f := flags.Add(c.Flags(), os.Getenv)
		if joinOnly { // joining only serves no /healthz
			_ = c.Flags().MarkHidden("health-listen")
		}
		c.RunE = func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.Config(joinOnly)
			if err != nil {
				return usageError{err}
			}
			return run(cmd.Context(), cfg, cmd.OutOrStdout())
		}
	}
	machines(root, false)
	join := &cobra.Command{
		Use:   "join [flags]",
		Short: "Join the machines that have not joined yet, print their node ids, and exit",
		Long: "join joins the machines of --data-dir that have not joined yet (a machine that has keeps its\n" +
			"identity), prints one line per machine (its node id, or why it was refused) and exits: non-zero if\n" +
			"any machine was refused or its answer was untrusted. It opens no session and serves no /healthz.",
		Args: noArgs,
	}
	machines(join, true)
	root.AddCommand(join, &cobra.Command{
		Use:   "healthcheck [URL]",
		Short: "GET a /healthz URL (default http://127.0.0.1:8085/healthz) and exit 0 when it answers 200",
		Args: func(c *cobra.Command, args []string) error {
			if err := cobra.MaximumNArgs(1)(c, args); err != nil {
				return usageError{err}
			}
			return nil
		},
		RunE: func(_ *cobra.Command, args []string) error {
			url := "http://127.0.0.1:8085/healthz"
			if len(args) == 1 {
				url = args[0]
			}
			if code := service.Healthcheck(url); code != 0 {
				return exitError{code: code}
			}
			return nil
		},
	})
	return root
}

// noArgs refuses positional arguments.
func noArgs(c *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("unexpected argument %q (see '%s --help')", args[0], c.CommandPath())}
	}
	return nil
}

// run runs the machines until ctx ends (or, joining only, until every
// machine has joined; then it prints one line per machine to out).
func run(ctx context.Context, cfg fakedaemon.Config, out io.Writer) error {
	logger, shutdown, err := telemetry.Setup(ctx, "fakedaemon")
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdown(sctx)
	}()
	r, err := fakedaemon.New(cfg, agent.Deps{Logger: logger})
	if err != nil {
		return err
	}
	stopProfiling, err := service.StartProfiling(cfg.Profiling, logger)
	if err != nil {
		return usageError{err}
	}
	defer stopProfiling()
	err = r.Run(ctx)
	if !cfg.JoinOnly {
		return err
	}
	return joinReport(r, err, out)
}

// joinReport prints one line per machine of a `join` run (the id of each
// that joined, the refusal of each that was refused) and returns err, or
// why not every machine joined: the command exits non-zero if any machine
// was refused.
func joinReport(r *agent.Runner, err error, out io.Writer) error {
	var refused *agent.JoinRefusedError
	if err != nil && !errors.As(err, &refused) {
		return err
	}
	for _, m := range r.Machines() {
		st := m.Status()
		switch {
		case st.Joined:
			fmt.Fprintf(out, "machine %d joined as %s (%s)\n", st.Index, st.NodeID, m.Dir())
		case st.JoinError != "":
			fmt.Fprintf(out, "machine %d refused: %s\n", st.Index, st.JoinError)
		}
	}
	if err != nil {
		return err
	}
	return r.Ready() // nil, or interrupted before every machine joined
}
