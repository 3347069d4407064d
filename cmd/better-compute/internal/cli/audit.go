package cli

import (
	"errors"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

// maxAuditPage is the largest page ListAudit serves.
const maxAuditPage = 1000

func (a *app) auditCmd() *cobra.Command {
	c := &cobra.Command{Use: "audit", Short: "Read the audit log of mutating calls (needs a tenant-admin or root-admin token)"}
	c.AddCommand(a.auditListCmd())
	return c
}

func (a *app) auditListCmd() *cobra.Command {
	var limit int
	c := &cobra.Command{
		Use:   "list [--limit N]",
		Short: "List the newest audit rows: your tenant's, or every tenant's with a root-admin token",
		Args:  cobra.NoArgs,
	}
	c.Flags().IntVar(&limit, "limit", 50, "how many rows, newest first")
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		if limit < 1 {
			return errors.New("--limit must be at least 1")
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		var entries []*computev1.AuditEntry
		var next int64
		for len(entries) < limit {
			res, err := cl.audit.ListAudit(cmd.Context(), connect.NewRequest(&computev1.ListAuditRequest{
				PageSize: int32(min(limit-len(entries), maxAuditPage)), PageToken: next}))
			if err != nil {
				return err
			}
			entries = append(entries, res.Msg.Entries...)
			next = res.Msg.NextPageToken
			if next == 0 {
				break
			}
		}
		type auditJSON struct {
			ID        int64     `json:"id"`
			At        time.Time `json:"at"`
			Tenant    string    `json:"tenant"`
			Token     string    `json:"token"`
			Role      string    `json:"role"`
			Procedure string    `json:"procedure"`
			Target    string    `json:"target"`
			Outcome   string    `json:"outcome"`
			Detail    string    `json:"detail"`
		}
		out := make([]auditJSON, 0, len(entries))
		for _, e := range entries {
			out = append(out, auditJSON{ID: e.Id, At: e.At.AsTime().UTC(), Tenant: e.TenantId, Token: e.TokenId, Role: e.Role,
				Procedure: e.Procedure, Target: e.Target, Outcome: e.Outcome, Detail: e.Detail})
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		rows := make([][]string, len(out))
		for i, e := range out {
			// "/bc.compute.v1.TokenService/RevokeToken" → "TokenService/RevokeToken"
			proc := e.Procedure[strings.LastIndex(e.Procedure, ".")+1:]
			rows[i] = []string{strconv.FormatInt(e.ID, 10), e.At.Format(time.RFC3339), orDash(e.Tenant), orDash(e.Token), orDash(e.Role), proc,
				orDash(e.Target), e.Outcome, e.Detail}
		}
		return table(a.env.Stdout, []string{"ID", "AT", "TENANT", "TOKEN", "ROLE", "CALL", "TARGET", "OUTCOME", "DETAIL"}, rows)
	}
	return c
}
