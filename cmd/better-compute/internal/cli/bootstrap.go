package cli

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/bootstrap"
	"github.com/better-compute/better-compute/pkg/store"
)

func (a *app) bootstrapCmd() *cobra.Command {
	var (
		dbURL   string
		wait    time.Duration
		migrate bool
	)
	o := bootstrap.Defaults()
	c := &cobra.Command{
		Use:   "bootstrap",
		Short: "Create the root tenant and token, a site, a pool and a join token (idempotent)",
		Long: "bootstrap connects to the database directly and ensures the root tenant with a root-admin API token,\n" +
			"a site, a metal-host pool with diag.nvml acceptance and a join token. It writes the join token to\n" +
			"--join-token-file (mode 0644: machines read it) and the root tenant, token and pool to --env-file\n" +
			"(mode 0600: it holds the root-admin token), and prints them as export lines. The root token is printed\n" +
			"once, by the run that mints it; a re-run reuses what the files hold while it is still valid and prints\n" +
			"the tenant and pool only.",
		Args: cobra.NoArgs,
	}
	f := c.Flags()
	f.StringVar(&dbURL, "database-url", "", "postgres:// URL (env BETTER_COMPUTE_DATABASE_URL)")
	f.DurationVar(&wait, "wait", time.Minute, "how long to wait for the database to answer")
	f.BoolVar(&migrate, "migrate", false, "apply pending migrations first")
	f.StringVar(&o.TenantName, "tenant", o.TenantName, "root tenant name")
	f.StringVar(&o.SiteName, "site", o.SiteName, "site name")
	f.StringVar(&o.Region, "region", o.Region, "region of a new site")
	f.StringVar(&o.PoolName, "pool", o.PoolName, "pool name")
	f.StringVar(&o.GPUModel, "gpu-model", o.GPUModel, "pool acceptance: GPU model substring (empty: any)")
	f.Int32Var(&o.ExpectGPUs, "expect-gpus", o.ExpectGPUs, "pool acceptance: exact GPU count (0: any)")
	f.Int32Var(&o.JoinMaxUses, "join-max-uses", o.JoinMaxUses, "uses of a new join token")
	f.DurationVar(&o.JoinTTL, "join-ttl", o.JoinTTL, "validity of a new join token")
	f.StringVar(&o.JoinTokenFile, "join-token-file", o.JoinTokenFile, "where the join token is written")
	f.StringVar(&o.EnvFile, "env-file", o.EnvFile, "where the root tenant, token and pool are written")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if o.JoinMaxUses < 1 {
			return fmt.Errorf("--join-max-uses must be at least 1")
		}
		if o.ExpectGPUs < 0 {
			return fmt.Errorf("--expect-gpus must not be negative")
		}
		if strings.TrimSpace(o.Region) == "" {
			// As CreateSite: a site is a place in a region.
			return fmt.Errorf("--region must not be empty: a site is a place in a region")
		}
		u, err := a.databaseURL(dbURL)
		if err != nil {
			return err
		}
		if migrate {
			if err := store.MigrateUp(u); err != nil {
				return err
			}
		}
		db, err := store.Open(cmd.Context(), u, a.env.Clock, wait, store.Options{MaxConns: 2})
		if err != nil {
			return err
		}
		defer db.Close()
		res, err := bootstrap.Run(cmd.Context(), db, o)
		if err != nil {
			return err
		}
		state := func(minted bool) string {
			if minted {
				return "new"
			}
			return "reused"
		}
		fmt.Fprintf(a.env.Stderr, "root tenant %s (%s), root token %s; site %s %s; pool %s %s; join token %s %s (%d of %d uses)\n",
			o.TenantName, res.TenantID, state(res.RootTokenMinted), o.SiteName, res.SiteID, o.PoolName, res.PoolID,
			res.JoinTokenID, state(res.JoinTokenMinted), res.JoinTokenUses, res.JoinTokenMaxUses)
		for _, p := range res.FilesWritten {
			fmt.Fprintf(a.env.Stderr, "wrote %s\n", p)
		}
		if res.RootTokenMinted {
			fmt.Fprintln(a.env.Stderr, "The root token below is printed only this once; keep it safe.")
		} else {
			fmt.Fprintf(a.env.Stderr, "The root token is not printed again; it is in %s.\n", o.EnvFile)
		}
		fmt.Fprint(a.env.Stdout, res.Announcement())
		return nil
	}
	return c
}
