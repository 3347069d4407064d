package cli

import (
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/iam"
)

func (a *app) tokensCmd() *cobra.Command {
	c := &cobra.Command{Use: "tokens", Short: "Mint, list and revoke API tokens (needs a tenant-admin or root-admin token)"}
	c.AddCommand(a.tokensCreateCmd(), a.tokensListCmd(), a.tokensRevokeCmd())
	return c
}

// roleNames are the values of --role, most powerful first.
func roleNames() []string {
	var out []string
	for _, r := range iam.Roles() {
		out = append(out, string(r))
	}
	return out
}

func (a *app) tokensCreateCmd() *cobra.Command {
	var (
		name, role, tenant string
		ttl                lifetime
	)
	c := &cobra.Command{
		Use:   "create --name NAME --role ROLE [--tenant TENANT_ID] [--ttl DURATION]",
		Short: "Mint an API token; its secret is printed once, on standard output",
		Long: "create mints an API token of --tenant (default: your token's tenant) with --role: root-admin,\n" +
			"tenant-admin, tenant-member or viewer. A tenant-admin mints tokens of its own tenant up to tenant-admin;\n" +
			"only a root-admin mints for other tenants or root-admin tokens. Only the token's SHA-256 is stored:\n" +
			"the secret printed on standard output is never shown again.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&name, "name", "", "what the token is for, e.g. ci (required)")
	c.Flags().StringVar(&role, "role", "", "root-admin, tenant-admin, tenant-member or viewer (required)")
	c.Flags().StringVar(&tenant, "tenant", "", "tenant id (default: your token's tenant)")
	_ = c.RegisterFlagCompletionFunc("tenant", a.completeTenantIDs)
	c.Flags().Var(&ttl, "ttl", "how long it is valid, 1s to 8784h (366d): a duration such as 90m, 24h or 7d, or whole seconds such as 3600 (default: it never expires)")
	_ = c.MarkFlagRequired("name")
	_ = c.MarkFlagRequired("role")
	_ = c.RegisterFlagCompletionFunc("role", func(*cobra.Command, []string, string) ([]cobra.Completion, cobra.ShellCompDirective) {
		return roleNames(), cobra.ShellCompDirectiveNoFileComp
	})
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if _, err := iam.ParseRole(role); err != nil {
			return fmt.Errorf("--role: %w", err)
		}
		// Unset, the token never expires; set, --ttl is a real lifetime: a
		// 0 that meant "forever" would turn a slip into a permanent
		// credential.
		if cmd.Flags().Changed("ttl") {
			if err := checkTTL(time.Duration(ttl), maxTokenTTL, "8784h (366 days)", "leave --ttl out for a token that never expires"); err != nil {
				return err
			}
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.apiTokens.CreateToken(cmd.Context(), connect.NewRequest(&computev1.CreateTokenRequest{
			TenantId: tenant, Name: name, Role: role, TtlSeconds: int64(time.Duration(ttl) / time.Second)}))
		if err != nil {
			return err
		}
		tok := res.Msg.Token
		expires := "never expires"
		if tok.ExpiresAt != nil {
			expires = "expires " + tok.ExpiresAt.AsTime().UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(a.env.Stderr, "API token %s (%s) of tenant %s, role %s, %s. The secret below is shown only once.\n",
			tok.Id, tok.Name, tok.TenantId, tok.Role, expires)
		fmt.Fprintln(a.env.Stdout, res.Msg.Secret)
		return nil
	}
	return a.fields(c, map[string]string{"name": "--name", "role": "--role", "tenant_id": "--tenant", "ttl_seconds": "--ttl"})
}

func (a *app) tokensListCmd() *cobra.Command {
	var tenant string
	c := &cobra.Command{Use: "list", Short: "List API tokens (never their secrets)", Args: cobra.NoArgs}
	c.Flags().StringVar(&tenant, "tenant", "", "tenant id (default: your token's tenant; others need root-admin)")
	_ = c.RegisterFlagCompletionFunc("tenant", a.completeTenantIDs)
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.apiTokens.ListTokens(cmd.Context(), connect.NewRequest(&computev1.ListTokensRequest{TenantId: tenant}))
		if err != nil {
			return err
		}
		type tokenJSON struct {
			ID         string     `json:"id"`
			Name       string     `json:"name"`
			Tenant     string     `json:"tenant"`
			Role       string     `json:"role"`
			CreatedAt  time.Time  `json:"createdAt"`
			ExpiresAt  *time.Time `json:"expiresAt"`
			RevokedAt  *time.Time `json:"revokedAt"`
			LastUsedAt *time.Time `json:"lastUsedAt"`
		}
		out := make([]tokenJSON, 0, len(res.Msg.Tokens))
		for _, t := range res.Msg.Tokens {
			out = append(out, tokenJSON{ID: t.Id, Name: t.Name, Tenant: t.TenantId, Role: t.Role,
				CreatedAt: t.CreatedAt.AsTime().UTC(), ExpiresAt: timeOrNil(t.ExpiresAt), RevokedAt: timeOrNil(t.RevokedAt),
				LastUsedAt: timeOrNil(t.LastUsedAt)})
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		now := a.env.Clock.Now()
		rows := make([][]string, len(out))
		for i, t := range out {
			state, expires := "active", "never"
			if t.ExpiresAt != nil {
				expires = t.ExpiresAt.Format(time.RFC3339)
			}
			switch {
			case t.RevokedAt != nil:
				state = "revoked"
			case t.ExpiresAt != nil && !t.ExpiresAt.After(now):
				state = "expired"
			}
			rows[i] = []string{t.ID, t.Name, t.Role, t.Tenant, expires, ago(now, t.LastUsedAt), state}
		}
		return table(a.env.Stdout, []string{"ID", "NAME", "ROLE", "TENANT", "EXPIRES", "LAST USED", "STATE"}, rows)
	}
	return a.fields(c, map[string]string{"tenant_id": "--tenant"})
}

func (a *app) tokensRevokeCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "revoke TOKEN_ID",
		Short: "Revoke an API token at once",
		Args:  exactArgs("TOKEN_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, err := a.clients()
			if err != nil {
				return err
			}
			res, err := cl.apiTokens.RevokeToken(cmd.Context(), connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: args[0]}))
			if err != nil {
				return err
			}
			fmt.Fprintf(a.env.Stdout, "revoked %s at %s\n", res.Msg.Token.Id,
				res.Msg.Token.RevokedAt.AsTime().UTC().Format(time.RFC3339))
			return nil
		},
	}
}

// maxTokenTTL is the longest --ttl of `tokens create` (the API's
// ttl_seconds limit, 366 days).
const maxTokenTTL = 8784 * time.Hour

// checkTTL checks a --ttl flag: positive, whole seconds and at most max
// (written maxText in errors, e.g. "720h (30 days)"); hint, when not empty,
// ends the error of a zero or negative one.
func checkTTL(ttl, max time.Duration, maxText, hint string) error {
	switch {
	case ttl <= 0:
		msg := fmt.Sprintf("--ttl must be positive (1s to %s), got %s", maxText, ttl)
		if hint != "" {
			msg += "; " + hint
		}
		return errors.New(msg)
	case ttl%time.Second != 0:
		return fmt.Errorf("--ttl must be a whole number of seconds, got %s", ttl)
	case ttl > max:
		return fmt.Errorf("--ttl must be at most %s, got %s", maxText, ttl)
	}
	return nil
}

// timeOrNil returns ts as a UTC time, or nil when it is unset.
func timeOrNil(ts *timestamppb.Timestamp) *time.Time {
	if ts == nil {
		return nil
	}
	t := ts.AsTime().UTC()
	return &t
}
