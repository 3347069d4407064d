package cli

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/store"
)

// databaseURL returns --database-url or BETTER_COMPUTE_DATABASE_URL.
func (a *app) databaseURL(flag string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	if v := a.env.Getenv("BETTER_COMPUTE_DATABASE_URL"); v != "" {
		return v, nil
	}
	return "", errors.New("no database: set BETTER_COMPUTE_DATABASE_URL or pass --database-url")
}

func (a *app) migrateCmd() *cobra.Command {
	var dbURL string
	c := &cobra.Command{Use: "migrate", Short: "Apply or revert the database schema's migrations"}
	c.PersistentFlags().StringVar(&dbURL, "database-url", "", "postgres:// URL (env BETTER_COMPUTE_DATABASE_URL)")

	report := func(u, verb string) error {
		v, dirty, err := store.MigrationVersion(u)
		if err != nil {
			return err
		}
		state := ""
		if dirty {
			state = " (dirty: a migration failed half-way; fix it by hand)"
		}
		fmt.Fprintf(a.env.Stdout, "%s: schema version %d%s on %s\n", verb, v, state, store.Redact(u))
		return nil
	}

	var roles bool
	up := &cobra.Command{
		Use:   "up [--roles]",
		Short: "Apply every pending migration; with --roles, also set up the services' database roles",
		Long: "up applies every pending migration, as the schema's owner (the URL's user).\n\n" +
			"With --roles it then sets up the services' database roles, " + strings.Join(store.Roles(), ", ") + ":\n" +
			"each service connects as its own (postgres://bc_<service>:PASSWORD@…) with only the privileges its\n" +
			"queries need (pkg/store/roles.sql; docs/architecture.md, \"Keys and roles\"). A missing role is created\n" +
			"NOLOGIN; each role's privileges on the schema are revoked and granted again from roles.sql, so run it after\n" +
			"every upgrade. A role whose password is in " + config.Prefix + "DB_PASSWORD_<SERVICE> (" + config.Prefix +
			"DB_PASSWORD_API,\n…_JOINSERVICE, …_GATEWAY, …_SCHEDULER, …_CONTROLLERS) gets LOGIN with it, sent as a\n" +
			"SCRAM-SHA-256 verifier; the others keep their login as it is. The owner needs CREATEROLE. Roles are the\n" +
			"server's: databases on one server share them.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			u, err := a.databaseURL(dbURL)
			if err != nil {
				return err
			}
			if err := store.MigrateUp(u); err != nil {
				return err
			}
			if err := report(u, "migrated up"); err != nil || !roles {
				return err
			}
			return a.setupRoles(cmd.Context(), u)
		},
	}
	up.Flags().BoolVar(&roles, "roles", false, "also set up the services' database roles and their privileges (see above)")

	var (
		steps int
		all   bool
	)
	down := &cobra.Command{
		Use:   "down [--steps N | --all]",
		Short: "Revert the last N migrations (1 by default); --all drops the whole schema",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if steps < 1 && !all {
				return errors.New("--steps must be at least 1 (or pass --all)")
			}
			if all && cmd.Flags().Changed("steps") {
				return errors.New("pass --steps or --all, not both")
			}
			u, err := a.databaseURL(dbURL)
			if err != nil {
				return err
			}
			if all {
				steps = 0
			}
			if err := store.MigrateDown(u, steps); err != nil {
				return err
			}
			return report(u, "migrated down")
		},
	}
	down.Flags().IntVar(&steps, "steps", 1, "how many migrations to revert")
	down.Flags().BoolVar(&all, "all", false, "revert every migration (drops all data)")

	version := &cobra.Command{
		Use:   "version",
		Short: "Print the applied schema version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			u, err := a.databaseURL(dbURL)
			if err != nil {
				return err
			}
			return report(u, "current")
		},
	}
	force := &cobra.Command{
		Use:   "force VERSION",
		Short: "Mark the schema as at VERSION (clean) without running anything, after repairing a failed migration by hand",
		Long: "force marks the schema as being at VERSION, clean, and runs nothing. `migrate up` already runs again a\n" +
			"migration that a killed run left half-done (each migration is one transaction); use force only when a\n" +
			"migration is marked dirty although it was applied, or after repairing one by hand. 0 means none applied.",
		Args: exactArgs("VERSION"),
		RunE: func(cmd *cobra.Command, args []string) error {
			v, err := strconv.ParseUint(args[0], 10, 32)
			if err != nil {
				return fmt.Errorf("VERSION: want a migration number such as 12, got %q", args[0])
			}
			u, err := a.databaseURL(dbURL)
			if err != nil {
				return err
			}
			if err := store.MigrateForce(u, uint(v)); err != nil {
				return err
			}
			return report(u, "forced")
		},
	}
	c.AddCommand(up, down, version, force)
	return c
}

// rolePasswordVar returns the variable holding the password of role
// bc_<service>: BETTER_COMPUTE_DB_PASSWORD_<SERVICE>.
func rolePasswordVar(role string) string {
	return config.Prefix + "DB_PASSWORD_" + strings.ToUpper(strings.TrimPrefix(role, "bc_"))
}

// setupRoles runs store.SetupRoles on the database at u with the passwords
// of the environment, and says what it did for each role.
func (a *app) setupRoles(ctx context.Context, u string) error {
	logins := map[string]string{}
	for _, role := range store.Roles() {
		if pw := a.env.Getenv(rolePasswordVar(role)); pw != "" {
			logins[role] = pw
		}
	}
	db, err := store.Open(ctx, u, a.env.Clock, 30*time.Second, store.Options{MaxConns: 2})
	if err != nil {
		return err
	}
	defer db.Close()
	if err := store.SetupRoles(ctx, db, logins); err != nil {
		return err
	}
	for _, role := range store.Roles() {
		login := "login unchanged (no " + rolePasswordVar(role) + ")"
		if _, ok := logins[role]; ok {
			login = "LOGIN with the password of " + rolePasswordVar(role)
		}
		fmt.Fprintf(a.env.Stdout, "role %s: privileges of roles.sql, %s\n", role, login)
	}
	return nil
}
