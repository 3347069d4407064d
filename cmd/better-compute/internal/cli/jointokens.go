package cli

import (
	"fmt"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

func (a *app) joinTokensCmd() *cobra.Command {
	c := &cobra.Command{Use: "join-tokens", Short: "Mint, list and revoke the tokens machines join with"}
	c.AddCommand(a.joinTokensCreateCmd(), a.joinTokensListCmd(), a.joinTokensRevokeCmd())
	return c
}

// maxJoinTokenTTL is the longest --ttl of `join-tokens create` (the API's
// ttl_seconds limit, 30 days).
const maxJoinTokenTTL = 720 * time.Hour

func (a *app) joinTokensCreateCmd() *cobra.Command {
	var (
		pool    string
		maxUses int32
		ttl     = lifetime(24 * time.Hour)
	)
	c := &cobra.Command{
		Use:   "create --pool POOL_ID [--max-uses N] [--ttl 24h]",
		Short: "Mint a join token; its secret is printed once, on standard output",
		Args:  cobra.NoArgs,
	}
	c.Flags().StringVar(&pool, "pool", "", "pool id the machines join (required)")
	_ = c.RegisterFlagCompletionFunc("pool", a.completePoolIDs)
	c.Flags().Int32Var(&maxUses, "max-uses", 1, "how many machines may join with it (1 to 100000)")
	c.Flags().Var(&ttl, "ttl", "how long it is valid, 1s to 720h (30d): a duration such as 90m, 24h or 7d, or whole seconds such as 3600")
	_ = c.MarkFlagRequired("pool")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkTTL(time.Duration(ttl), maxJoinTokenTTL, "720h (30 days)", ""); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.tokens.CreateJoinToken(cmd.Context(), connect.NewRequest(&computev1.CreateJoinTokenRequest{
			PoolId: pool, MaxUses: maxUses, TtlSeconds: int64(time.Duration(ttl) / time.Second)}))
		if err != nil {
			return err
		}
		jt := res.Msg.JoinToken
		fmt.Fprintf(a.env.Stderr, "Join token %s for pool %s: %d use(s), expires %s. The secret below is shown only once.\n",
			jt.Id, jt.PoolId, jt.MaxUses, jt.ExpiresAt.AsTime().UTC().Format(time.RFC3339))
		fmt.Fprintln(a.env.Stdout, res.Msg.Secret)
		return nil
	}
	return a.fields(c, map[string]string{"pool_id": "--pool", "max_uses": "--max-uses", "ttl_seconds": "--ttl"})
}

func (a *app) joinTokensListCmd() *cobra.Command {
	var pool string
	c := &cobra.Command{Use: "list", Short: "List join tokens (never their secrets)", Args: cobra.NoArgs}
	c.Flags().StringVar(&pool, "pool", "", "only tokens of this pool id")
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
		res, err := cl.tokens.ListJoinTokens(cmd.Context(), connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: pool}))
		if err != nil {
			return err
		}
		type tokenJSON struct {
			ID        string     `json:"id"`
			Pool      string     `json:"pool"`
			Uses      int32      `json:"uses"`
			MaxUses   int32      `json:"maxUses"`
			ExpiresAt time.Time  `json:"expiresAt"`
			RevokedAt *time.Time `json:"revokedAt"`
		}
		out := make([]tokenJSON, 0, len(res.Msg.JoinTokens))
		for _, jt := range res.Msg.JoinTokens {
			t := tokenJSON{ID: jt.Id, Pool: jt.PoolId, Uses: jt.Uses, MaxUses: jt.MaxUses, ExpiresAt: jt.ExpiresAt.AsTime()}
			if jt.RevokedAt != nil {
				r := jt.RevokedAt.AsTime()
				t.RevokedAt = &r
			}
			out = append(out, t)
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		now := a.env.Clock.Now()
		rows := make([][]string, len(out))
		for i, t := range out {
			state := "active"
			switch {
			case t.RevokedAt != nil:
				state = "revoked"
			case !t.ExpiresAt.After(now):
				state = "expired"
			case t.Uses >= t.MaxUses:
				state = "used up"
			}
			rows[i] = []string{t.ID, t.Pool, strconv.Itoa(int(t.Uses)) + "/" + strconv.Itoa(int(t.MaxUses)),
				t.ExpiresAt.UTC().Format(time.RFC3339), state}
		}
		return table(a.env.Stdout, []string{"ID", "POOL", "USES", "EXPIRES", "STATE"}, rows)
	}
	return a.fields(c, map[string]string{"pool_id": "--pool"})
}

func (a *app) joinTokensRevokeCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "revoke JOIN_TOKEN_ID",
		Short: "Revoke a join token (machines already joined keep their identity)",
		Args:  exactArgs("JOIN_TOKEN_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, err := a.clients()
			if err != nil {
				return err
			}
			res, err := cl.tokens.RevokeJoinToken(cmd.Context(), connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: args[0]}))
			if err != nil {
				return err
			}
			fmt.Fprintf(a.env.Stdout, "revoked %s at %s\n", res.Msg.JoinToken.Id,
				res.Msg.JoinToken.RevokedAt.AsTime().UTC().Format(time.RFC3339))
			return nil
		},
	}
}
