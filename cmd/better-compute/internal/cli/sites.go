package cli

import (
	"context"
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) sitesCmd() *cobra.Command {
	c := &cobra.Command{Use: "sites", Short: "List and create sites"}
	c.AddCommand(a.sitesListCmd(), a.sitesCreateCmd())
	return c
}

type siteJSON struct {
	ID     string `json:"id"`
	Name   string `json:"name"`
	Region string `json:"region"`
}

func (a *app) sitesListCmd() *cobra.Command {
	c := &cobra.Command{Use: "list", Short: "List sites", Args: cobra.NoArgs}
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.pools.ListSites(cmd.Context(), connect.NewRequest(&computev1.ListSitesRequest{}))
		if err != nil {
			return err
		}
		out := make([]siteJSON, 0, len(res.Msg.Sites))
		for _, s := range res.Msg.Sites {
			out = append(out, siteJSON{ID: s.Id, Name: s.Name, Region: s.Region})
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		rows := make([][]string, len(out))
		for i, s := range out {
			rows[i] = []string{s.ID, s.Name, orDash(s.Region)}
		}
		return table(a.env.Stdout, []string{"ID", "NAME", "REGION"}, rows)
	}
	return c
}

// resolveSite returns the id of the site whose id or name is site (ids
// first: a site id is never another site's name, since names have no
// underscore). Sites are few, so it reads them all (ListSites). Errors:
// neither matches (both were tried), or the RPC's.
func resolveSite(ctx context.Context, cl *apiClients, site string) (string, error) {
	res, err := cl.pools.ListSites(ctx, connect.NewRequest(&computev1.ListSitesRequest{}))
	if err != nil {
		return "", err
	}
	for _, s := range res.Msg.Sites {
		if s.Id == site {
			return s.Id, nil
		}
	}
	for _, s := range res.Msg.Sites {
		if s.Name == site {
			return s.Id, nil
		}
	}
	return "", fmt.Errorf("--site: no site has the id or the name %q (sites list shows them)", site)
}

func (a *app) sitesCreateCmd() *cobra.Command {
	var region string
	c := &cobra.Command{
		Use:   "create NAME --region REGION",
		Short: "Create a site (a place in a region, shared by every tenant; root-admin)",
		Args:  exactArgs("NAME"),
	}
	c.Flags().StringVar(&region, "region", "", "the region the site is in (required)")
	_ = c.MarkFlagRequired("region")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.pools.CreateSite(cmd.Context(), connect.NewRequest(&computev1.CreateSiteRequest{Name: args[0], Region: region}))
		if err != nil {
			return err
		}
		fmt.Fprintln(a.env.Stdout, res.Msg.Site.Id)
		return nil
	}
	return a.fields(c, map[string]string{"name": "NAME", "region": "--region"})
}
