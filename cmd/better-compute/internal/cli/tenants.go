package cli

import (
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) tenantsCmd() *cobra.Command {
	c := &cobra.Command{Use: "tenants", Short: "Create and list tenants (creating needs a root-admin token)"}
	c.AddCommand(a.tenantsCreateCmd(), a.tenantsListCmd())
	return c
}

func (a *app) tenantsCreateCmd() *cobra.Command {
	var parent string
	c := &cobra.Command{
		Use:   "create NAME [--parent TENANT_ID]",
		Short: "Create a tenant under the root tenant (or --parent); prints its id",
		Long: "create makes a tenant named NAME (lowercase letters, digits and dashes) under --parent, by default\n" +
			"the root tenant. Give it an administrator with 'better-compute tokens create --tenant ID --role tenant-admin'.",
		Args: exactArgs("NAME"),
	}
	c.Flags().StringVar(&parent, "parent", "", "parent tenant id (default: the root tenant)")
	_ = c.RegisterFlagCompletionFunc("parent", a.completeTenantIDs)
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.tenants.CreateTenant(cmd.Context(), connect.NewRequest(&computev1.CreateTenantRequest{Name: args[0], ParentId: parent}))
		if err != nil {
			return err
		}
		fmt.Fprintln(a.env.Stdout, res.Msg.Tenant.Id)
		return nil
	}
	return a.fields(c, map[string]string{"name": "NAME", "parent_id": "--parent"})
}

func (a *app) tenantsListCmd() *cobra.Command {
	c := &cobra.Command{Use: "list", Short: "List the tenants you see (all of them with a root-admin token)", Args: cobra.NoArgs}
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.tenants.ListTenants(cmd.Context(), connect.NewRequest(&computev1.ListTenantsRequest{}))
		if err != nil {
			return err
		}
		type tenantJSON struct {
			ID        string    `json:"id"`
			Name      string    `json:"name"`
			Parent    string    `json:"parent"`
			CreatedAt time.Time `json:"createdAt"`
		}
		out := make([]tenantJSON, 0, len(res.Msg.Tenants))
		for _, t := range res.Msg.Tenants {
			out = append(out, tenantJSON{ID: t.Id, Name: t.Name, Parent: t.ParentId, CreatedAt: t.CreatedAt.AsTime().UTC()})
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		rows := make([][]string, len(out))
		for i, t := range out {
			rows[i] = []string{t.ID, t.Name, orDash(t.Parent), t.CreatedAt.Format(time.RFC3339)}
		}
		return table(a.env.Stdout, []string{"ID", "NAME", "PARENT", "CREATED"}, rows)
	}
	return c
}
