package cli

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) nodesCmd() *cobra.Command {
	c := &cobra.Command{Use: "nodes", Short: "List, inspect, cordon and revoke nodes"}
	c.AddCommand(a.nodesListCmd(), a.nodesGetCmd(), a.nodesRevokeCmd(), a.nodesCordonCmd(), a.nodesUncordonCmd())
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
	// CordonReason is set while the node is cordoned.
	CordonReason string     `json:"cordonReason,omitempty"`
	Hostname     string     `json:"hostname"`
	RevokedAt    *time.Time `json:"revokedAt,omitempty"`
}

func toNodeJSON(n *computev1.Node) nodeJSON {
	out := nodeJSON{ID: n.Id, Pool: n.PoolId, State: n.ProvisionState, Reason: n.ProvisionReason, GPUs: len(n.Gpus),
		Model: n.GpuModel, Gateway: n.GatewayId, Reachable: n.Reachable, Cordoned: n.Cordoned, CordonReason: n.CordonReason, Hostname: n.Hostname}
	if n.LastSeen != nil {
		t := n.LastSeen.AsTime()
		out.LastSeen = &t
	}
	if n.RevokedAt != nil {
		t := n.RevokedAt.AsTime()
		out.RevokedAt = &t
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
			state := n.State
			if n.RevokedAt != nil {
				// A revoked node keeps its provision state, but it can
				// never hold a session again.
				state += ",revoked"
			}
			if !n.Reachable && n.LastSeen != nil {
				// Heard from before, then marked by the liveness sweeper:
				// no gateway heard from it for the liveness timeout.
				state += ",unreachable"
			}
			if n.Cordoned {
				// Cordoned is a flag beside the provision state.
				state += ",cordoned"
				reason = n.CordonReason
			}
			rows[i] = []string{n.ID, n.Pool, state, strconv.Itoa(n.GPUs), orDash(n.Model), orDash(n.Gateway),
				ago(now, n.LastSeen), reason}
		}
		return table(a.env.Stdout, []string{"ID", "POOL", "STATE", "GPUS", "MODEL", "GATEWAY", "LAST SEEN", "REASON"}, rows)
	}
	return c
}

func (a *app) nodesGetCmd() *cobra.Command {
	return a.idJSONCmd("get NODE_ID", "Show one node as JSON (revokedAt and certNotAfter when set)",
		func(ctx context.Context, cl *apiClients, id string) (proto.Message, error) {
			res, err := cl.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: id}))
			if err != nil {
				return nil, err
			}
			return res.Msg.GetNode(), nil
		})
}

func (a *app) nodesRevokeCmd() *cobra.Command {
	var reason string
	c := &cobra.Command{
		Use:   "revoke NODE_ID",
		Short: "Revoke a node: its certificates stop working and its open session is closed within seconds",
		Long: "Revoke every certificate of a node. The node can no longer open a session or renew its\n" +
			"certificate, and the gateway closes its open session within seconds. Revoking a revoked\n" +
			"node changes nothing. The machine must join again, as a new node, to come back.",
		Args: cobra.ExactArgs(1),
	}
	c.Flags().StringVar(&reason, "reason", "", "why, recorded in the audit log (at most 256 characters)")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.nodes.RevokeNode(cmd.Context(), connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: args[0], Reason: reason}))
		if err != nil {
			return err
		}
		n := res.Msg.GetNode()
		fmt.Fprintf(a.env.Stdout, "revoked %s at %s (%d certificate(s) revoked now)\n", n.GetId(),
			n.GetRevokedAt().AsTime().UTC().Format(time.RFC3339), res.Msg.GetCertificatesRevoked())
		return nil
	}
	return c
}

func (a *app) nodesCordonCmd() *cobra.Command {
	var reason string
	c := &cobra.Command{
		Use:   "cordon NODE_ID --reason TEXT",
		Short: "Cordon a node: no new reservations are placed on it; its reservations stay",
		Long: "Cordon a node: the scheduler places no new reservation on it, and the reservations it\n" +
			"holds stay. Cordoning a cordoned node updates the reason. Undo with `nodes uncordon`.",
		Args: cobra.ExactArgs(1),
	}
	c.Flags().StringVar(&reason, "reason", "", "why (required, at most 256 characters); shown by nodes list")
	_ = c.MarkFlagRequired("reason")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.nodes.CordonNode(cmd.Context(), connect.NewRequest(&computev1.CordonNodeRequest{NodeId: args[0], Reason: reason}))
		if err != nil {
			return err
		}
		fmt.Fprintf(a.env.Stdout, "cordoned %s: %s\n", res.Msg.GetNode().GetId(), res.Msg.GetNode().GetCordonReason())
		return nil
	}
	return c
}

func (a *app) nodesUncordonCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "uncordon NODE_ID",
		Short: "Uncordon a node: the scheduler may place reservations on it again",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, err := a.clients()
			if err != nil {
				return err
			}
			res, err := cl.nodes.UncordonNode(cmd.Context(), connect.NewRequest(&computev1.UncordonNodeRequest{NodeId: args[0]}))
			if err != nil {
				return err
			}
			fmt.Fprintf(a.env.Stdout, "uncordoned %s\n", res.Msg.GetNode().GetId())
			return nil
		},
	}
}
