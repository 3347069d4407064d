package cli

import (
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

func (a *app) sitesCreateCmd() *cobra.Command {
	var region string
	c := &cobra.Command{Use: "create NAME", Short: "Create a site", Args: cobra.ExactArgs(1)}
	c.Flags().StringVar(&region, "region", "", "the site's region")
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
	return c
}
