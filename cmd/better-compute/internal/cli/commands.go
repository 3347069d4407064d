package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

// commandPollInterval is how often `commands run --wait` reads the command.
const commandPollInterval = 250 * time.Millisecond

// commandKinds are the kinds `commands run` accepts, as the API does.
var commandKinds = []string{"diag.nvml", "inventory.refresh", "logs.collect", "node.reboot"}

// commandOpen reports whether a command in state may still change.
func commandOpen(state string) bool {
	return state == "queued" || state == "delivered" || state == "running"
}

// commandJSON is one command as the CLI prints it in JSON: an element of
// `commands list -o json` and the whole of `commands get` and `commands
// run`, so that one field has one name in all three. Times are RFC 3339 in
// UTC.
type commandJSON struct {
	ID   string `json:"id"`
	Node string `json:"node"`
	// Kind is diag.nvml, inventory.refresh, logs.collect or node.reboot.
	Kind string `json:"kind"`
	// State is queued, delivered, running, succeeded, failed, expired or
	// canceled.
	State string `json:"state"`
	// Error says why the command failed or expired ("" otherwise).
	Error string `json:"error"`
	// Deliveries is how many times a gateway sent the command to the node.
	Deliveries int32 `json:"deliveries"`
	// RetrySafe commands may run again after the node lost its journal.
	RetrySafe bool `json:"retrySafe"`
	// RequestID is the idempotency key it was run with ("" for none).
	RequestID string    `json:"requestId"`
	CreatedAt time.Time `json:"createdAt"`
	UpdatedAt time.Time `json:"updatedAt"`
	// Deadline is when the command expires unless it finished.
	Deadline time.Time `json:"deadline"`
	// FinishedAt is null while the command is open.
	FinishedAt *time.Time `json:"finishedAt"`
	// Result is what a succeeded command reported (a JSON object), null
	// when it has none.
	Result json.RawMessage `json:"result"`
}

func toCommandJSON(c *computev1.Command) commandJSON {
	out := commandJSON{ID: c.Id, Node: c.NodeId, Kind: c.Kind, State: c.State, Error: c.Error, Deliveries: c.Deliveries,
		RetrySafe: c.RetrySafe, RequestID: c.RequestId, CreatedAt: c.CreatedAt.AsTime().UTC(),
		UpdatedAt: c.UpdatedAt.AsTime().UTC(), Deadline: c.Deadline.AsTime().UTC(), FinishedAt: timeOrNil(c.FinishedAt)}
	switch {
	case c.ResultJson == "":
	case json.Valid([]byte(c.ResultJson)):
		out.Result = json.RawMessage(c.ResultJson)
	default:
		// Not JSON after all: keep it, as a string.
		b, _ := json.Marshal(c.ResultJson)
		out.Result = b
	}
	return out
}

func (a *app) commandsCmd() *cobra.Command {
	c := &cobra.Command{Use: "commands", Short: "Run commands on nodes and show them"}
	c.AddCommand(a.commandsRunCmd(), a.commandsGetCmd(), a.commandsListCmd())
	return c
}

func (a *app) commandsRunCmd() *cobra.Command {
	var (
		node, requestID string
		timeout         time.Duration
		wait            bool
	)
	c := &cobra.Command{
		Use:   "run --node NODE_ID diag.nvml|inventory.refresh|logs.collect|node.reboot [--timeout D] [--wait]",
		Short: "Run a command on a node; prints the command as JSON",
		Long: "run queues a command for --node and prints it as JSON (as commands get does). The node runs it\n" +
			"at most once, even when its connection drops; it must have finished before --timeout (1s to 24h,\n" +
			"default 5m; 0 or a negative timeout is refused) or it expires. node.reboot reboots the machine\n" +
			"once the commands queued before it on the node have finished (or reached their deadlines), and\n" +
			"is never run twice; commands queued after it run once the machine is back. A retry-safe command\n" +
			"(any kind but node.reboot) that a reboot or crash cut short runs again after the boot. With\n" +
			"--request-id a retry returns the first command instead of queuing another. --wait polls until\n" +
			"the command has finished: exit 0 when it succeeded, 1 when it failed or expired. Needs a\n" +
			"tenant-admin or root-admin token.",
		Args:      exactArgs("KIND"),
		ValidArgs: commandKinds,
	}
	c.Flags().StringVar(&node, "node", "", "node id (required)")
	_ = c.RegisterFlagCompletionFunc("node", a.completeNodeIDs)
	c.Flags().DurationVar(&timeout, "timeout", 0, "how long the command may take from now, 1s to 24h (default 5m)")
	c.Flags().StringVar(&requestID, "request-id", "", "idempotency key: a retry with the same id returns the same command")
	c.Flags().BoolVar(&wait, "wait", false, "wait until the command succeeded, failed or expired")
	_ = c.MarkFlagRequired("node")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		kind := args[0]
		known := false
		for _, k := range commandKinds {
			known = known || k == kind
		}
		if !known {
			return fmt.Errorf("unknown command kind %q (want diag.nvml, inventory.refresh, logs.collect or node.reboot)", kind)
		}
		// Unset, the API's default (5m) applies; set, it must be a real
		// timeout: 0 does not mean "the default" or "none".
		if cmd.Flags().Changed("timeout") && timeout <= 0 {
			return fmt.Errorf("--timeout must be positive (1s to 24h; leave it out for 5m), got %s", timeout)
		}
		req := &computev1.RunCommandRequest{NodeId: node, Kind: kind, RequestId: requestID}
		if timeout > 0 {
			req.Timeout = durationpb.New(timeout)
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.commands.RunCommand(cmd.Context(), connect.NewRequest(req))
		if err != nil {
			return err
		}
		cm := res.Msg.Command
		if wait {
			// No deadline of its own: the command expires at its deadline.
			cm, _, err = pollWhile(cmd.Context(), a.env.Clock, commandPollInterval, time.Time{}, cm,
				func(c *computev1.Command) bool { return commandOpen(c.State) },
				func(ctx context.Context) (*computev1.Command, error) {
					got, err := cl.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{CommandId: cm.Id}))
					if err != nil {
						if ctx.Err() == nil && transientError(err) {
							// The command goes on without the API: keep
							// waiting for it rather than report it failed.
							fmt.Fprintf(a.env.Stderr, "commands run: waiting for %s: %v; retrying\n", cm.Id, err)
							return cm, nil
						}
						return nil, err
					}
					return got.Msg.Command, nil
				})
			if err != nil {
				return err
			}
		}
		if err := writeJSON(a.env.Stdout, toCommandJSON(cm)); err != nil {
			return err
		}
		if wait && cm.State != "succeeded" {
			return fmt.Errorf("command %s %s: %s", cm.Id, cm.State, orDash(cm.Error))
		}
		return nil
	}
	return a.fields(c, map[string]string{"node_id": "--node", "kind": "KIND", "timeout": "--timeout", "request_id": "--request-id"})
}

// transientError reports whether err, from a call whose context is still
// live, says the API could not be reached or answer for now (Unavailable, a
// dropped connection, a timeout) rather than refused the call. A connection
// lost mid-response is Unavailable too: every client of the CLI reports it
// so (lostConnection).
func transientError(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeCanceled, connect.CodeDeadlineExceeded, connect.CodeUnknown:
		return true
	}
	return false
}

func (a *app) commandsGetCmd() *cobra.Command {
	return a.idJSONCmd("get COMMAND_ID", "Show a command as JSON, with its result",
		func(ctx context.Context, cl *apiClients, id string) (any, error) {
			res, err := cl.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{CommandId: id}))
			if err != nil {
				return nil, err
			}
			return toCommandJSON(res.Msg.GetCommand()), nil
		})
}

func (a *app) commandsListCmd() *cobra.Command {
	var node string
	c := &cobra.Command{
		Use:   "list [--node NODE_ID]",
		Short: "List commands (all pages), newest first",
		Args:  cobra.NoArgs,
	}
	c.Flags().StringVar(&node, "node", "", "only commands of this node id")
	_ = c.RegisterFlagCompletionFunc("node", a.completeNodeIDs)
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		var cs []*computev1.Command
		page := ""
		for {
			res, err := cl.commands.ListCommands(cmd.Context(), connect.NewRequest(&computev1.ListCommandsRequest{
				NodeId: node, PageToken: page}))
			if err != nil {
				return err
			}
			cs = append(cs, res.Msg.Commands...)
			if page = res.Msg.NextPageToken; page == "" {
				break
			}
		}
		if *format == formatJSON {
			out := make([]commandJSON, len(cs))
			for i, c := range cs {
				out[i] = toCommandJSON(c)
			}
			return writeJSON(a.env.Stdout, out)
		}
		now := a.env.Clock.Now()
		rows := make([][]string, len(cs))
		for i, c := range cs {
			created := c.CreatedAt.AsTime()
			rows[i] = []string{c.Id, c.NodeId, c.Kind, c.State, strconv.Itoa(int(c.Deliveries)), ago(now, &created), orDash(c.Error)}
		}
		return table(a.env.Stdout, []string{"ID", "NODE", "KIND", "STATE", "DELIVERIES", "CREATED", "ERROR"}, rows)
	}
	return a.fields(c, map[string]string{"node_id": "--node"})
}
