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
	ID   string `json:"id"`
	Name string `json:"name"`
	// Site is the site id.
	Site string `json:"site"`
	Kind string `json:"kind"`
	// Owner is the tenant owning the pool.
	Owner      string           `json:"owner"`
	Check      string           `json:"check"`
	GPUModel   string           `json:"gpuModel"`
	ExpectGPUs int32            `json:"expectGpus"`
	Nodes      map[string]int32 `json:"nodes"`
	// Offer is the pool's offer to your tenant, null when there is none
	// (you own the pool and did not offer it to yourself).
	Offer *poolOfferJSON `json:"offer"`
}

// poolOfferJSON is the offer of a pool to your tenant in poolJSON.
type poolOfferJSON struct {
	// GPUQuota is how many GPUs your tenant may hold at once in the pool.
	GPUQuota int32 `json:"gpuQuota"`
	// GPUsInUse is what your pending, binding and active reservations hold.
	GPUsInUse int32 `json:"gpusInUse"`
}

func (a *app) poolsListCmd() *cobra.Command {
	var site string
	c := &cobra.Command{
		Use:   "list [--site SITE]",
		Short: "List the pools your tenant owns or was offered, with node counts and your quota",
		Long: "list shows the pools your tenant owns and those offered to it (every pool for a root-admin\n" +
			"token), each with its node counts by state and, when the pool is offered to your tenant, your\n" +
			"GPU quota and the GPUs your reservations hold (QUOTA: in use/quota): the pools you may reserve from.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&site, "site", "", "only pools of this site (id or name)")
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		siteID := ""
		if site != "" {
			if siteID, err = resolveSite(cmd.Context(), cl, site); err != nil {
				return err
			}
		}
		res, err := cl.pools.ListPools(cmd.Context(), connect.NewRequest(&computev1.ListPoolsRequest{SiteId: siteID}))
		if err != nil {
			return err
		}
		out := make([]poolJSON, 0, len(res.Msg.Pools))
		for _, p := range res.Msg.Pools {
			counts := p.NodeCounts
			if counts == nil {
				counts = map[string]int32{}
			}
			pj := poolJSON{ID: p.Id, Name: p.Name, Site: p.SiteId, Kind: p.Kind, Owner: p.OwnerTenantId,
				Check: p.Acceptance.GetCheck(), GPUModel: p.Acceptance.GetGpuModel(),
				ExpectGPUs: p.Acceptance.GetExpectGpuCount(), Nodes: counts}
			if o := p.GetOffer(); o != nil {
				pj.Offer = &poolOfferJSON{GPUQuota: o.GpuQuota, GPUsInUse: o.GpusInUse}
			}
			out = append(out, pj)
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
			quota := "-"
			if p.Offer != nil {
				quota = fmt.Sprintf("%d/%d", p.Offer.GPUsInUse, p.Offer.GPUQuota)
			}
			rows[i] = []string{p.ID, p.Name, p.Site, p.Kind, orDash(p.GPUModel), expect, quota, nodeCounts(p.Nodes)}
		}
		return table(a.env.Stdout, []string{"ID", "NAME", "SITE", "KIND", "GPU MODEL", "EXPECT GPUS", "QUOTA", "NODES"}, rows)
	}
	return a.fields(c, map[string]string{"site_id": "--site"})
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
		Use:   "create NAME --site SITE",
		Short: "Create a metal-host pool with diag.nvml acceptance",
		Long: "create makes a metal-host pool owned by your tenant in --site (a site id, or a site name: sites\n" +
			"list shows both) and prints its id.",
		Args: exactArgs("NAME"),
	}
	c.Flags().StringVar(&site, "site", "", "site id or name (required)")
	c.Flags().StringVar(&gpuModel, "gpu-model", "", "GPU model every GPU must match (substring, e.g. H100)")
	c.Flags().Int32Var(&expect, "expect-gpus", 0, "exact number of GPUs a node must have (0: any)")
	_ = c.MarkFlagRequired("site")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		siteID, err := resolveSite(cmd.Context(), cl, site)
		if err != nil {
			return err
		}
		res, err := cl.pools.CreatePool(cmd.Context(), connect.NewRequest(&computev1.CreatePoolRequest{
			SiteId: siteID, Name: args[0], Kind: "metal-host",
			Acceptance: &computev1.Acceptance{Check: "diag.nvml", GpuModel: gpuModel, ExpectGpuCount: expect},
		}))
		if err != nil {
			return err
		}
		fmt.Fprintln(a.env.Stdout, res.Msg.Pool.Id)
		return nil
	}
	return a.fields(c, map[string]string{"site_id": "--site", "name": "NAME", "acceptance.gpu_model": "--gpu-model", "acceptance.expect_gpu_count": "--expect-gpus"})
}
