package cli

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) poolsCmd() *cobra.Command {
	c := &cobra.Command{Use: "pools", Short: "List, create and offer pools"}
	c.AddCommand(a.poolsListCmd(), a.poolsCreateCmd(), a.poolsOfferCmd(), a.poolsOffersCmd())
	return c
}

// poolJSON is one pool of `pools list -o json`.
type poolJSON struct {
	ID         string           `json:"id"`
	Name       string           `json:"name"`
	Site       string           `json:"site"`
	Kind       string           `json:"kind"`
	Owner      string           `json:"owner"`
	Check      string           `json:"check"`
	GPUModel   string           `json:"gpuModel"`
	ExpectGPUs int32            `json:"expectGpus"`
	Nodes      map[string]int32 `json:"nodes"`
}

func (a *app) poolsListCmd() *cobra.Command {
	var site string
	c := &cobra.Command{Use: "list", Short: "List pools with their node counts", Args: cobra.NoArgs}
	c.Flags().StringVar(&site, "site", "", "only pools of this site id")
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.pools.ListPools(cmd.Context(), connect.NewRequest(&computev1.ListPoolsRequest{SiteId: site}))
		if err != nil {
			return err
		}
		out := make([]poolJSON, 0, len(res.Msg.Pools))
		for _, p := range res.Msg.Pools {
			counts := p.NodeCounts
			if counts == nil {
				counts = map[string]int32{}
			}
			out = append(out, poolJSON{ID: p.Id, Name: p.Name, Site: p.SiteId, Kind: p.Kind, Owner: p.OwnerTenantId,
				Check: p.Acceptance.GetCheck(), GPUModel: p.Acceptance.GetGpuModel(),
				ExpectGPUs: p.Acceptance.GetExpectGpuCount(), Nodes: counts})
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		rows := make([][]string, len(out))
		for i, p := range out {
			expect := "-"
			if p.ExpectGPUs > 0 {
				expect = strconv.Itoa(int(p.ExpectGPUs))
			}
			rows[i] = []string{p.ID, p.Name, p.Site, p.Kind, orDash(p.GPUModel), expect, nodeCounts(p.Nodes)}
		}
		return table(a.env.Stdout, []string{"ID", "NAME", "SITE", "KIND", "GPU MODEL", "EXPECT GPUS", "NODES"}, rows)
	}
	return c
}

// nodeCounts renders {"adopted": 2, "joining": 1} as "adopted=2 joining=1".
func nodeCounts(m map[string]int32) string {
	if len(m) == 0 {
		return "0"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

func (a *app) poolsCreateCmd() *cobra.Command {
	var (
		site, gpuModel string
		expect         int32
	)
	c := &cobra.Command{
		Use:   "create NAME --site SITE_ID",
		Short: "Create a metal-host pool with diag.nvml acceptance",
		Args:  cobra.ExactArgs(1),
	}
	c.Flags().StringVar(&site, "site", "", "site id (required)")
	c.Flags().StringVar(&gpuModel, "gpu-model", "", "GPU model every GPU must match (substring, e.g. H100)")
	c.Flags().Int32Var(&expect, "expect-gpus", 0, "exact number of GPUs a node must have (0: any)")
	_ = c.MarkFlagRequired("site")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.pools.CreatePool(cmd.Context(), connect.NewRequest(&computev1.CreatePoolRequest{
			SiteId: site, Name: args[0], Kind: "metal-host",
			Acceptance: &computev1.Acceptance{Check: "diag.nvml", GpuModel: gpuModel, ExpectGpuCount: expect},
		}))
		if err != nil {
			return err
		}
		fmt.Fprintln(a.env.Stdout, res.Msg.Pool.Id)
		return nil
	}
	return c
}
