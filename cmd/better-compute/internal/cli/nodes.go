package cli

import (
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) nodesCmd() *cobra.Command {
	c := &cobra.Command{Use: "nodes", Short: "List and inspect nodes"}
	c.AddCommand(a.nodesListCmd(), a.nodesGetCmd())
	return c
}

// nodeJSON is one node of `nodes list -o json`.
type nodeJSON struct {
	ID        string     `json:"id"`
	Pool      string     `json:"pool"`
	State     string     `json:"state"`
	Reason    string     `json:"reason"`
	GPUs      int        `json:"gpus"`
	Model     string     `json:"model"`
	Gateway   string     `json:"gateway"`
	LastSeen  *time.Time `json:"lastSeen"`
	Reachable bool       `json:"reachable"`
	Cordoned  bool       `json:"cordoned"`
	Hostname  string     `json:"hostname"`
}

func toNodeJSON(n *computev1.Node) nodeJSON {
	out := nodeJSON{ID: n.Id, Pool: n.PoolId, State: n.ProvisionState, Reason: n.ProvisionReason, GPUs: len(n.Gpus),
		Model: n.GpuModel, Gateway: n.GatewayId, Reachable: n.Reachable, Cordoned: n.Cordoned, Hostname: n.Hostname}
	if n.LastSeen != nil {
		t := n.LastSeen.AsTime()
		out.LastSeen = &t
	}
	return out
}

func (a *app) nodesListCmd() *cobra.Command {
	var pool string
	c := &cobra.Command{
		Use:   "list",
		Short: "List nodes (all pages), optionally of one pool",
		Args:  cobra.NoArgs,
	}
	c.Flags().StringVar(&pool, "pool", "", "only nodes of this pool id")
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		var nodes []*computev1.Node
		page := ""
		for {
			res, err := cl.nodes.ListNodes(cmd.Context(), connect.NewRequest(&computev1.ListNodesRequest{PoolId: pool, PageToken: page}))
			if err != nil {
				return err
			}
			nodes = append(nodes, res.Msg.Nodes...)
			if page = res.Msg.NextPageToken; page == "" {
				break
			}
		}
		out := make([]nodeJSON, len(nodes))
		for i, n := range nodes {
			out[i] = toNodeJSON(n)
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		now := a.env.Clock.Now()
		rows := make([][]string, len(out))
		for i, n := range out {
			reason := ""
			if n.State == "acceptance_failed" {
				reason = n.Reason
			}
			rows[i] = []string{n.ID, n.Pool, n.State, strconv.Itoa(n.GPUs), orDash(n.Model), orDash(n.Gateway),
				ago(now, n.LastSeen), reason}
		}
		return table(a.env.Stdout, []string{"ID", "POOL", "STATE", "GPUS", "MODEL", "GATEWAY", "LAST SEEN", "REASON"}, rows)
	}
	return c
}

func (a *app) nodesGetCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "get NODE_ID",
		Short: "Show one node as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, err := a.clients()
			if err != nil {
				return err
			}
			res, err := cl.nodes.GetNode(cmd.Context(), connect.NewRequest(&computev1.GetNodeRequest{NodeId: args[0]}))
			if err != nil {
				return err
			}
			return writeProto(a.env.Stdout, res.Msg.Node)
		},
	}
}
