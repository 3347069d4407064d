package cli

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) nodesCmd() *cobra.Command {
	c := &cobra.Command{Use: "nodes", Short: "List, inspect, cordon and revoke nodes"}
	c.AddCommand(a.nodesListCmd(), a.nodesGetCmd(), a.nodesRevokeCmd(), a.nodesCordonCmd(), a.nodesUncordonCmd())
	return c
}

// nodeJSON is one node as the CLI prints it in JSON: an element of `nodes
// list -o json` and the whole of `nodes get`, so that one field has one name
// in both. Times are RFC 3339 in UTC.
type nodeJSON struct {
	ID   string `json:"id"`
	Pool string `json:"pool"`
	// State is the provision state: joining, accepting, adopted or
	// acceptance_failed.
	State string `json:"state"`
	// Reason says why acceptance failed ("" otherwise).
	Reason string `json:"reason"`
	// GPUs is how many GPUs the node has (Devices lists them).
	GPUs int `json:"gpus"`
	// Model is the model shared by the node's GPUs ("" without GPUs).
	Model string `json:"model"`
	// Gateway is the gateway holding the node's live session, if any.
	Gateway string `json:"gateway"`
	// LastSeen is null for a node never heard from.
	LastSeen  *time.Time `json:"lastSeen"`
	Reachable bool       `json:"reachable"`
	Cordoned  bool       `json:"cordoned"`
	// CordonReason is set while the node is cordoned.
	CordonReason string `json:"cordonReason,omitempty"`
	Hostname     string `json:"hostname"`
	// RevokedAt is set once the node's certificates were revoked.
	RevokedAt *time.Time `json:"revokedAt,omitempty"`
	// RevokeReason is the reason the (first) revocation gave; absent when
	// the node is not revoked or no reason was given.
	RevokeReason string `json:"revokeReason,omitempty"`
	// CertNotAfter is when the node's newest certificate expires, when it
	// has one.
	CertNotAfter *time.Time `json:"certNotAfter,omitempty"`
	// Variant is the fake hardware variant the node joined with ("" for
	// real hardware).
	Variant string `json:"variant"`
	BootID  string `json:"bootId"`
	// SpecGeneration is the generation of the node's desired state;
	// ObservedGeneration the one the node reported applied.
	SpecGeneration     int64     `json:"specGeneration"`
	ObservedGeneration int64     `json:"observedGeneration"`
	CreatedAt          time.Time `json:"createdAt"`
	// Devices are the node's GPUs, by index.
	Devices []gpuJSON `json:"devices"`
}

// gpuJSON is one GPU of a node in nodeJSON.
type gpuJSON struct {
	Index int32  `json:"index"`
	UUID  string `json:"uuid"`
	Model string `json:"model"`
	// MemoryBytes is the GPU's memory in bytes.
	MemoryBytes int64 `json:"memoryBytes"`
}

func toNodeJSON(n *computev1.Node) nodeJSON {
	out := nodeJSON{ID: n.Id, Pool: n.PoolId, State: n.ProvisionState, Reason: n.ProvisionReason, GPUs: len(n.Gpus),
		Model: n.GpuModel, Gateway: n.GatewayId, LastSeen: timeOrNil(n.LastSeen), Reachable: n.Reachable,
		Cordoned: n.Cordoned, CordonReason: n.CordonReason, Hostname: n.Hostname, RevokedAt: timeOrNil(n.RevokedAt),
		RevokeReason: n.RevokeReason, CertNotAfter: timeOrNil(n.CertNotAfter), Variant: n.Variant, BootID: n.BootId, SpecGeneration: n.SpecGeneration,
		ObservedGeneration: n.ObservedGeneration, CreatedAt: n.CreatedAt.AsTime().UTC(), Devices: make([]gpuJSON, len(n.Gpus))}
	for i, g := range n.Gpus {
		out.Devices[i] = gpuJSON{Index: g.Index, UUID: g.Uuid, Model: g.Model, MemoryBytes: g.MemoryBytes}
	}
	return out
}

func (a *app) nodesListCmd() *cobra.Command {
	var pool string
	c := &cobra.Command{
		Use:   "list",
		Short: "List nodes (all pages), optionally of one pool",
		Long: "List your tenant's nodes (every tenant's with a root-admin token): id, pool, state (the provision\n" +
			"state, with ,revoked ,unreachable or ,cordoned beside it, and the reason acceptance failed, the cordon\n" +
			"reason or the revoke reason), GPUs, model, gateway, last seen. -o json prints each node as nodes get does.\n" +
			"--pool of a pool another tenant offered you lists none: its nodes are that tenant's.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&pool, "pool", "", "only nodes of this pool id")
	_ = c.RegisterFlagCompletionFunc("pool", a.completePoolIDs)
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
			if n.RevokedAt != nil && n.RevokeReason != "" {
				// Revocation is final: its reason says most.
				reason = n.RevokeReason
			}
			rows[i] = []string{n.ID, n.Pool, state, strconv.Itoa(n.GPUs), orDash(n.Model), orDash(n.Gateway),
				ago(now, n.LastSeen), reason}
		}
		return table(a.env.Stdout, []string{"ID", "POOL", "STATE", "GPUS", "MODEL", "GATEWAY", "LAST SEEN", "REASON"}, rows)
	}
	return a.fields(c, map[string]string{"pool_id": "--pool"})
}

func (a *app) nodesGetCmd() *cobra.Command {
	c := a.idJSONCmd("get NODE_ID", "Show one node as JSON, as nodes list -o json shows it, with its GPUs",
		func(ctx context.Context, cl *apiClients, id string) (any, error) {
			res, err := cl.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: id}))
			if err != nil {
				return nil, err
			}
			return toNodeJSON(res.Msg.GetNode()), nil
		})
	c.ValidArgsFunction = firstArg(a.completeNodeIDs)
	c.Long = "Show one node as JSON: id, pool, state, reason, gpus (a count), model, gateway, lastSeen, reachable,\n" +
		"cordoned, cordonReason, revokedAt and revokeReason when set, hostname, certNotAfter when set, variant,\n" +
		"bootId, specGeneration, observedGeneration, createdAt, and devices: its GPUs, each index, uuid, model and\n" +
		"memoryBytes (a node that failed acceptance lists the GPUs it reported)."
	return c
}

func (a *app) nodesRevokeCmd() *cobra.Command {
	var reason string
	c := &cobra.Command{
		Use:   "revoke NODE_ID",
		Short: "Revoke a node: its certificates stop working and its open session is closed within seconds",
		Long: "Revoke every certificate of a node. The node can no longer open a session or renew its\n" +
			"certificate, and the gateway closes its open session within seconds; its reservations fail.\n" +
			"--reason is recorded on the node (nodes get shows it as revokeReason) and in the audit log.\n" +
			"Revoking a revoked node changes nothing and exits 0: the node keeps the time and reason of\n" +
			"its first revocation, and a new --reason is not recorded (this says so). The machine must\n" +
			"join again, as a new node, to come back.",
		Args:              exactArgs("NODE_ID"),
		ValidArgsFunction: firstArg(a.completeNodeIDs),
	}
	c.Flags().StringVar(&reason, "reason", "", "why, recorded on the node and in the audit log (at most 256 characters)")
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
		at := n.GetRevokedAt().AsTime().UTC().Format(time.RFC3339)
		if !res.Msg.GetAlreadyRevoked() {
			fmt.Fprintf(a.env.Stdout, "revoked %s at %s (%d certificate(s) revoked now)\n", n.GetId(), at,
				res.Msg.GetCertificatesRevoked())
			return nil
		}
		first := "no reason given"
		if n.GetRevokeReason() != "" {
			first = "reason: " + cell(n.GetRevokeReason())
		}
		fmt.Fprintf(a.env.Stdout, "%s was already revoked at %s (%s); nothing changed (%d certificate(s) revoked now)\n",
			n.GetId(), at, first, res.Msg.GetCertificatesRevoked())
		if strings.TrimSpace(reason) != "" {
			fmt.Fprintf(a.env.Stderr, "warning: --reason was not recorded: a node keeps the reason of its first revocation\n")
		}
		return nil
	}
	return a.fields(c, map[string]string{"node_id": "NODE_ID", "reason": "--reason"})
}

func (a *app) nodesCordonCmd() *cobra.Command {
	var reason string
	c := &cobra.Command{
		Use:   "cordon NODE_ID --reason TEXT",
		Short: "Cordon a node: no new reservations are placed on it; its reservations stay",
		Long: "Cordon a node: the scheduler places no new reservation on it, and the reservations it\n" +
			"holds stay. Cordoning a cordoned node updates the reason (and says it was cordoned, and why).\n" +
			"A revoked node cannot be cordoned. Undo with `nodes uncordon`.",
		Args:              exactArgs("NODE_ID"),
		ValidArgsFunction: firstArg(a.completeNodeIDs),
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
		id, now := res.Msg.GetNode().GetId(), cell(res.Msg.GetNode().GetCordonReason())
		switch {
		case !res.Msg.GetAlreadyCordoned():
			fmt.Fprintf(a.env.Stdout, "cordoned %s: %s\n", id, now)
		case res.Msg.GetChanged():
			fmt.Fprintf(a.env.Stdout, "%s was already cordoned (reason: %s); reason now: %s\n", id, cell(res.Msg.GetPreviousReason()), now)
		default:
			fmt.Fprintf(a.env.Stdout, "%s was already cordoned with this reason; nothing changed: %s\n", id, now)
		}
		return nil
	}
	return a.fields(c, map[string]string{"node_id": "NODE_ID", "reason": "--reason"})
}

func (a *app) nodesUncordonCmd() *cobra.Command {
	return &cobra.Command{
		Use:               "uncordon NODE_ID",
		Short:             "Uncordon a node: the scheduler may place reservations on it again",
		Args:              exactArgs("NODE_ID"),
		ValidArgsFunction: firstArg(a.completeNodeIDs),
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, err := a.clients()
			if err != nil {
				return err
			}
			res, err := cl.nodes.UncordonNode(cmd.Context(), connect.NewRequest(&computev1.UncordonNodeRequest{NodeId: args[0]}))
			if err != nil {
				return err
			}
			if !res.Msg.GetChanged() {
				fmt.Fprintf(a.env.Stdout, "%s was not cordoned; nothing changed\n", res.Msg.GetNode().GetId())
				return nil
			}
			fmt.Fprintf(a.env.Stdout, "uncordoned %s\n", res.Msg.GetNode().GetId())
			return nil
		},
	}
}
