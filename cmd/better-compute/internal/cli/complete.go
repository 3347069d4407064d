package cli

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

// Shell completion of ids: node, pool, reservation and tenant ids, as
// flags' values and as arguments, asked of the API with the run's URL and
// token (--url, --token, the environment). Each lists what the caller sees,
// with a description, matched without regard to case, and never offers
// files; when the API cannot be asked (unreachable, no token) it offers
// nothing. Flags of a fixed set of values (-o, --state, --types, --role)
// complete those values, with no call.

const (
	// completeTimeout bounds a completion's calls: a shell waits for it.
	completeTimeout = 5 * time.Second
	// completePages is the most pages a completion reads: it is not a
	// listing.
	completePages = 10
)

// completion is one candidate id and its description.
type completion struct{ id, desc string }

// completeWith runs list, which returns one page of candidates and the next
// page token, and offers those whose id starts with toComplete.
func (a *app) completeWith(cmd *cobra.Command, toComplete string,
	list func(ctx context.Context, cl *apiClients, page string) ([]completion, string, error),
) ([]cobra.Completion, cobra.ShellCompDirective) {
	cl, err := a.clients()
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), completeTimeout)
	defer cancel()
	var out []cobra.Completion
	page := ""
	for range completePages {
		got, next, err := list(ctx, cl, page)
		if err != nil {
			break
		}
		for _, c := range got {
			if strings.HasPrefix(strings.ToLower(c.id), strings.ToLower(toComplete)) {
				out = append(out, cobra.CompletionWithDesc(c.id, cell(c.desc)))
			}
		}
		if page = next; page == "" {
			break
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

// completeNodeIDs completes with the ids of the nodes the caller sees, each
// with its hostname and state.
func (a *app) completeNodeIDs(cmd *cobra.Command, _ []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	return a.completeWith(cmd, toComplete, func(ctx context.Context, cl *apiClients, page string) ([]completion, string, error) {
		res, err := cl.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PageToken: page}))
		if err != nil {
			return nil, "", err
		}
		out := make([]completion, len(res.Msg.GetNodes()))
		for i, n := range res.Msg.GetNodes() {
			desc := n.GetProvisionState()
			if n.GetHostname() != "" {
				desc = n.GetHostname() + ", " + desc
			}
			out[i] = completion{n.GetId(), desc}
		}
		return out, res.Msg.GetNextPageToken(), nil
	})
}

// completePoolIDs completes with the ids of the pools the caller sees (it
// owns them or they are offered to its tenant), each with its name and GPU
// model.
func (a *app) completePoolIDs(cmd *cobra.Command, _ []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	return a.completeWith(cmd, toComplete, func(ctx context.Context, cl *apiClients, _ string) ([]completion, string, error) {
		res, err := cl.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
		if err != nil {
			return nil, "", err
		}
		out := make([]completion, len(res.Msg.GetPools()))
		for i, p := range res.Msg.GetPools() {
			desc := p.GetName()
			if m := p.GetAcceptance().GetGpuModel(); m != "" {
				desc += ", " + m
			}
			out[i] = completion{p.GetId(), desc}
		}
		return out, "", nil
	})
}

// completeReservationIDs completes with the ids of the caller's
// reservations, each with its state, GPUs and pool; with open, only those
// not ended (pending, binding, active).
func (a *app) completeReservationIDs(open bool) cobra.CompletionFunc {
	return func(cmd *cobra.Command, _ []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		return a.completeWith(cmd, toComplete, func(ctx context.Context, cl *apiClients, page string) ([]completion, string, error) {
			res, err := cl.res.ListReservations(ctx, connect.NewRequest(&computev1.ListReservationsRequest{PageToken: page}))
			if err != nil {
				return nil, "", err
			}
			var out []completion
			for _, r := range res.Msg.GetReservations() {
				switch r.GetState() {
				case "pending", "binding", "active":
				default:
					if open {
						continue
					}
				}
				out = append(out, completion{r.GetId(), fmt.Sprintf("%s, %d GPUs of %s", r.GetState(), r.GetGpus(), r.GetPoolId())})
			}
			return out, res.Msg.GetNextPageToken(), nil
		})
	}
}

// completeTenantIDs completes with the ids of the tenants the caller sees
// (all of them for a root-admin, its own otherwise), each with its name.
func (a *app) completeTenantIDs(cmd *cobra.Command, _ []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	return a.completeWith(cmd, toComplete, func(ctx context.Context, cl *apiClients, _ string) ([]completion, string, error) {
		res, err := cl.tenants.ListTenants(ctx, connect.NewRequest(&computev1.ListTenantsRequest{}))
		if err != nil {
			return nil, "", err
		}
		out := make([]completion, len(res.Msg.GetTenants()))
		for i, t := range res.Msg.GetTenants() {
			out[i] = completion{t.GetId(), t.GetName()}
		}
		return out, "", nil
	})
}

// completeValues is a completion of a flag that takes one of values.
func completeValues(values ...string) cobra.CompletionFunc {
	return func(*cobra.Command, []string, string) ([]cobra.Completion, cobra.ShellCompDirective) {
		return values, cobra.ShellCompDirectiveNoFileComp
	}
}

// completeList is a completion of a flag that takes a comma-separated list
// of values: the entry after the last comma completes with each of values
// not yet in the list, after the entries before it, and no space follows,
// so that another comma may.
func completeList(values ...string) cobra.CompletionFunc {
	return func(_ *cobra.Command, _ []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		head, last := "", toComplete
		if i := strings.LastIndexByte(toComplete, ','); i >= 0 {
			head, last = toComplete[:i+1], toComplete[i+1:]
		}
		given := strings.Split(head, ",")
		var out []cobra.Completion
		for _, v := range values {
			if strings.HasPrefix(v, last) && !slices.Contains(given, v) {
				out = append(out, head+v)
			}
		}
		return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
	}
}

// firstArg makes complete a completion of a command's one argument: nothing
// once it is given.
func firstArg(complete cobra.CompletionFunc) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(args) > 0 {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		return complete(cmd, args, toComplete)
	}
}
