package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
)

// reservePollInterval is how often `reserve --wait` reads the reservation.
const reservePollInterval = 250 * time.Millisecond

// The delay between the retries of `reserve --wait` after a transient
// error doubles from reserveRetryFirst up to reserveRetryMost, and starts
// again from reserveRetryFirst after a read that succeeded.
const (
	reserveRetryFirst = 500 * time.Millisecond
	reserveRetryMost  = 10 * time.Second
)

// parseQuota parses --quota: "gpu=N" with N ≥ 0.
func parseQuota(s string) (int32, error) {
	k, v, ok := strings.Cut(s, "=")
	if !ok || strings.TrimSpace(k) != "gpu" {
		return 0, fmt.Errorf("--quota: want gpu=N (e.g. gpu=64), got %q", s)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 32)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("--quota: want gpu=N with N a whole number ≥ 0, got %q", s)
	}
	return int32(n), nil
}

func (a *app) poolsOfferCmd() *cobra.Command {
	var to, quota string
	c := &cobra.Command{
		Use:   "offer POOL_ID --to TENANT_ID --quota gpu=N",
		Short: "Offer a pool to a tenant with a GPU quota, or change the quota of the offer",
		Long: "offer lets --to reserve GPUs of the pool, holding at most N at once (pending, binding and active\n" +
			"reservations count). Offering again changes the quota; a lower quota ends no reservation. Needs a\n" +
			"root-admin token, or a tenant-admin token of the pool's owner to offer it to its own tenant (another\n" +
			"tenant reads to a tenant-admin as one that does not exist: only a root-admin offers across tenants).",
		Args:              exactArgs("POOL_ID"),
		ValidArgsFunction: firstArg(a.completePoolIDs),
	}
	c.Flags().StringVar(&to, "to", "", "tenant id to offer the pool to (required)")
	_ = c.RegisterFlagCompletionFunc("to", a.completeTenantIDs)
	c.Flags().StringVar(&quota, "quota", "", "GPU quota, gpu=N (required)")
	_ = c.MarkFlagRequired("to")
	_ = c.MarkFlagRequired("quota")
	c.RunE = func(cmd *cobra.Command, args []string) error {
		n, err := parseQuota(quota)
		if err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.pools.OfferPool(cmd.Context(), connect.NewRequest(&computev1.OfferPoolRequest{PoolId: args[0],
			TenantId: to, GpuQuota: n}))
		if err != nil {
			return err
		}
		o := res.Msg.Offer
		fmt.Fprintf(a.env.Stdout, "pool %s offered to %s: quota gpu=%d (%d in use)\n", o.PoolId, o.TenantId, o.GpuQuota, o.GpusInUse)
		return nil
	}
	return a.fields(c, map[string]string{"pool_id": "POOL_ID", "tenant_id": "--to", "gpu_quota": "--quota"})
}

func (a *app) poolsOffersCmd() *cobra.Command {
	var pool string
	c := &cobra.Command{
		Use:   "offers [--pool POOL_ID]",
		Short: "List the offers made to your tenant and those of its pools, with the GPUs in use",
		Args:  cobra.NoArgs,
	}
	c.Flags().StringVar(&pool, "pool", "", "only offers of this pool id")
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
		res, err := cl.pools.ListOffers(cmd.Context(), connect.NewRequest(&computev1.ListOffersRequest{PoolId: pool}))
		if err != nil {
			return err
		}
		type offerJSON struct {
			Pool      string    `json:"pool"`
			Tenant    string    `json:"tenant"`
			GPUQuota  int32     `json:"gpuQuota"`
			GPUsInUse int32     `json:"gpusInUse"`
			CreatedAt time.Time `json:"createdAt"`
		}
		out := make([]offerJSON, len(res.Msg.Offers))
		rows := make([][]string, len(res.Msg.Offers))
		for i, o := range res.Msg.Offers {
			out[i] = offerJSON{Pool: o.PoolId, Tenant: o.TenantId, GPUQuota: o.GpuQuota, GPUsInUse: o.GpusInUse,
				CreatedAt: o.CreatedAt.AsTime()}
			rows[i] = []string{o.PoolId, o.TenantId, strconv.Itoa(int(o.GpuQuota)), strconv.Itoa(int(o.GpusInUse))}
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		return table(a.env.Stdout, []string{"POOL", "TENANT", "GPU QUOTA", "GPUS IN USE"}, rows)
	}
	return a.fields(c, map[string]string{"pool_id": "--pool"})
}

func (a *app) reserveCmd() *cobra.Command {
	var (
		pool, start, requestID string
		gpus                   int32
		dur, timeout           time.Duration
		wait                   bool
	)
	c := &cobra.Command{
		Use:   "reserve --pool POOL_ID --gpus N --for DURATION [--start TIME] [--request-id ID] [--wait [--timeout D]]",
		Short: "Reserve N GPUs of one node of a pool offered to your tenant",
		Long: "reserve asks for --gpus GPUs of one node of --pool for --for (e.g. 1h) from --start (RFC 3339,\n" +
			"default now) and prints the reservation as JSON. It starts pending; the scheduler places it\n" +
			"(binding) and it turns active once the node has bound the GPUs. With --request-id a retry returns\n" +
			"the first reservation instead of making another. --wait polls until it is active (exit 0) or\n" +
			"failed (exit 1), for at most --timeout (default 1m; only with --wait), retrying while the API\n" +
			"cannot be reached; if it stops waiting, the reservation stays queued and holds its quota\n" +
			"(`better-compute release ID` cancels it). A reservation no node of\n" +
			"the pool can hold (more GPUs than any node has) is failed at once: reserve exits 1 with the reason.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&pool, "pool", "", "pool id (required)")
	_ = c.RegisterFlagCompletionFunc("pool", a.completePoolIDs)
	c.Flags().Int32Var(&gpus, "gpus", 0, "how many GPUs, all on one node (required)")
	c.Flags().DurationVar(&dur, "for", 0, "how long, e.g. 30m or 1h (required)")
	c.Flags().StringVar(&start, "start", "", "start time, RFC 3339 (e.g. 2025-03-01T10:00:00Z; default now)")
	c.Flags().StringVar(&requestID, "request-id", "", "idempotency key: a retry with the same id returns the same reservation")
	c.Flags().BoolVar(&wait, "wait", false, "wait until the reservation is active or failed")
	c.Flags().DurationVar(&timeout, "timeout", time.Minute, "how long --wait waits (only with --wait)")
	_ = c.MarkFlagRequired("pool")
	_ = c.MarkFlagRequired("gpus")
	_ = c.MarkFlagRequired("for")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		req := &computev1.ReserveRequest{PoolId: pool, Gpus: gpus, Duration: durationpb.New(dur), RequestId: requestID}
		if start != "" {
			t, err := time.Parse(time.RFC3339, start)
			if err != nil {
				return fmt.Errorf("--start: want an RFC 3339 time such as 2025-03-01T10:00:00Z: %w", err)
			}
			req.StartTime = timestamppb.New(t)
		}
		// --timeout bounds --wait and nothing else: a reservation has no
		// deadline of its own (--for is how long it holds the GPUs).
		if cmd.Flags().Changed("timeout") && !wait {
			return errors.New("--timeout applies only with --wait (how long to wait for the reservation to be active): add --wait or drop --timeout")
		}
		if wait && timeout <= 0 {
			return errors.New("--timeout must be positive")
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.res.Reserve(cmd.Context(), connect.NewRequest(req))
		if err != nil {
			return a.notOffered(err, pool)
		}
		r := res.Msg.Reservation
		if wait {
			var timedOut bool
			deadline := a.env.Clock.Now().Add(timeout)
			delay := reserveRetryFirst
			last := r
			r, timedOut, err = pollWhile(cmd.Context(), a.env.Clock, reservePollInterval, deadline, r,
				func(r *computev1.Reservation) bool { return r.State == "pending" || r.State == "binding" },
				func(ctx context.Context) (*computev1.Reservation, error) {
					got, err := cl.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: r.Id}))
					if err != nil {
						if ctx.Err() != nil || !transientError(err) {
							return last, err
						}
						// The reservation goes on without the API: keep
						// waiting for it until --timeout.
						pause := min(delay, max(deadline.Sub(a.env.Clock.Now()), 0))
						fmt.Fprintf(a.env.Stderr, "reserve: waiting for %s: %v; retrying in %s\n", last.Id, err, pause)
						delay = min(2*delay, reserveRetryMost)
						return last, clock.Sleep(ctx, a.env.Clock, pause)
					}
					delay = reserveRetryFirst
					last = got.Msg.Reservation
					return last, nil
				})
			if err != nil || timedOut {
				if werr := writeProto(a.env.Stdout, r); werr != nil {
					return werr
				}
				if cerr := (*connect.Error)(nil); errors.As(err, &cerr) {
					return connect.NewError(cerr.Code(), fmt.Errorf("waiting for reservation %s: %s; %s", r.Id, cerr.Message(), stillHeld(r)))
				}
				if err != nil {
					return fmt.Errorf("waiting for reservation %s: %w; %s", r.Id, err, stillHeld(r))
				}
				return fmt.Errorf("reservation %s is still %s after %s; %s", r.Id, r.State, timeout, stillHeld(r))
			}
		}
		if err := writeProto(a.env.Stdout, r); err != nil {
			return err
		}
		// A reservation no node of the pool can hold is failed at once, with
		// or without --wait: the outcome is known, and it is a failure.
		if (wait && r.State != "active") || r.State == "failed" {
			return fmt.Errorf("reservation %s is %s: %s", r.Id, r.State, orDash(cell(r.Reason)))
		}
		return nil
	}
	return a.fields(c, map[string]string{"pool_id": "--pool", "gpus": "--gpus", "duration": "--for", "start_time": "--start", "request_id": "--request-id"})
}

// stillHeld says what becomes of a reservation reserve --wait stopped
// waiting for (pending or binding, as last read): it stays, holds its
// GPUs of the pool's quota, and how to cancel it.
func stillHeld(r *computev1.Reservation) string {
	how := "queued (pending)"
	if r.State != "pending" {
		how = r.State
	}
	return fmt.Sprintf("it is still %s and holds %d GPUs of pool %s's quota: cancel it with `better-compute release %s`",
		how, r.Gpus, r.PoolId, r.Id)
}

// notOffered is a refusal of Reserve for a pool that is not offered to
// the caller's tenant, with what to do about it; other errors pass as they
// are. The API answers NotFound for a pool the caller does not see (another
// tenant's pool not offered to its tenant reads as a missing one: the CLI
// cannot tell the two apart either, and says both), PermissionDenied
// "pool_id: pool P is not offered to tenant T" for one it sees (it owns it,
// or is root-admin) that is not offered to its tenant.
func (a *app) notOffered(err error, pool string) error {
	var cerr *connect.Error
	if !errors.As(err, &cerr) {
		return err
	}
	// The caller's tenant is the one its token belongs to, which no call
	// of the API returns (BETTER_COMPUTE_TENANT may name another): the hint
	// leaves it to the caller.
	offer := "better-compute pools offer " + pool + " --to <your tenant id> --quota gpu=N"
	msg := cerr.Message()
	switch {
	case cerr.Code() == connect.CodeNotFound && msg == "pool_id: pool "+pool+" not found":
		msg = "pool_id: pool " + pool + " not found, or not offered to your tenant (`better-compute pools list` shows the pools " +
			"you may reserve from, and a root-admin, or a tenant-admin of the pool's tenant, offers one with `" + offer + "`)"
	case cerr.Code() == connect.CodePermissionDenied && strings.HasPrefix(msg, "pool_id: pool "+pool+" is not offered to tenant "):
		tenant := strings.TrimPrefix(msg, "pool_id: pool "+pool+" is not offered to tenant ")
		msg += " (offer it first: `better-compute pools offer " + pool + " --to " + tenant + " --quota gpu=N`)"
	default:
		return err
	}
	return connect.NewError(cerr.Code(), errors.New(msg))
}

func (a *app) releaseCmd() *cobra.Command {
	c := &cobra.Command{
		Use:   "release RESERVATION_ID",
		Short: "Release a reservation now: its GPUs are unbound and freed; prints it as JSON",
		Long: "release ends the reservation now (its GPUs are unbound and freed) and prints it as JSON. A\n" +
			"reservation that had already ended (released, expired or failed) stays as it is: release says so\n" +
			"on standard error, with its state, prints nothing on standard output and exits 0.",
		Args:              exactArgs("RESERVATION_ID"),
		ValidArgsFunction: firstArg(a.completeReservationIDs(true)),
	}
	c.RunE = func(cmd *cobra.Command, args []string) error {
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.res.ReleaseReservation(cmd.Context(), connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: args[0]}))
		if err != nil {
			return err
		}
		r := res.Msg.GetReservation()
		if res.Msg.GetAlreadyEnded() {
			fmt.Fprintf(a.env.Stderr, "reservation %s had already ended: %s; nothing to release\n", r.GetId(), endedAs(r))
			return nil
		}
		return writeProto(a.env.Stdout, r)
	}
	return c
}

// reservationStates are the states of a reservation, in the order it
// passes them: open (pending, binding, active), then ended.
var reservationStates = []string{"pending", "binding", "active", "released", "expired", "failed"}

// endedAs says how an ended reservation ended: its state, when (RFC 3339,
// UTC) and, when it has one, the reason ("failed at 2025-03-01T10:00:00Z:
// no node of the pool has 9 GPUs").
func endedAs(r *computev1.Reservation) string {
	out := r.GetState()
	if r.GetEndedAt() != nil {
		out += " at " + r.GetEndedAt().AsTime().UTC().Format(time.RFC3339)
	}
	if r.GetReason() != "" {
		out += ": " + cell(r.GetReason())
	}
	return out
}

func (a *app) reservationsCmd() *cobra.Command {
	c := &cobra.Command{Use: "reservations", Short: "List and show your tenant's reservations"}
	c.AddCommand(a.reservationsListCmd(), a.reservationsGetCmd())
	return c
}

func (a *app) reservationsListCmd() *cobra.Command {
	var pool, state string
	c := &cobra.Command{
		Use:   "list [--pool POOL_ID] [--state STATE]",
		Short: "List reservations (all pages), oldest first",
		Args:  cobra.NoArgs,
	}
	c.Flags().StringVar(&pool, "pool", "", "only reservations of this pool id")
	_ = c.RegisterFlagCompletionFunc("pool", a.completePoolIDs)
	c.Flags().StringVar(&state, "state", "", "only this state: pending, binding, active, released, expired or failed")
	_ = c.RegisterFlagCompletionFunc("state", completeValues(reservationStates...))
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		var rs []*computev1.Reservation
		page := ""
		for {
			res, err := cl.res.ListReservations(cmd.Context(), connect.NewRequest(&computev1.ListReservationsRequest{
				PoolId: pool, State: state, PageToken: page}))
			if err != nil {
				return err
			}
			rs = append(rs, res.Msg.Reservations...)
			if page = res.Msg.NextPageToken; page == "" {
				break
			}
		}
		if *format == formatJSON {
			// The same shape as `reservations get` and `reserve`: the
			// API's Reservation in its JSON form, one array.
			out := make([]json.RawMessage, len(rs))
			for i, r := range rs {
				b, err := protojson.Marshal(r)
				if err != nil {
					return err
				}
				out[i] = b
			}
			return writeJSON(a.env.Stdout, out)
		}
		rows := make([][]string, len(rs))
		for i, r := range rs {
			rows[i] = []string{r.Id, r.PoolId, strconv.Itoa(int(r.Gpus)), r.State, orDash(r.NodeId),
				r.StartTime.AsTime().UTC().Format(time.RFC3339), r.EndTime.AsTime().UTC().Format(time.RFC3339), r.Reason}
		}
		return table(a.env.Stdout, []string{"ID", "POOL", "GPUS", "STATE", "NODE", "START", "END", "REASON"}, rows)
	}
	return a.fields(c, map[string]string{"pool_id": "--pool", "state": "--state"})
}

func (a *app) reservationsGetCmd() *cobra.Command {
	c := a.idJSONCmd("get RESERVATION_ID", "Show one reservation as JSON (binding holds the CDI device names once active)",
		func(ctx context.Context, cl *apiClients, id string) (any, error) {
			res, err := cl.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: id}))
			if err != nil {
				return nil, err
			}
			return res.Msg.GetReservation(), nil
		})
	c.ValidArgsFunction = firstArg(a.completeReservationIDs(false))
	return c
}

func (a *app) usageCmd() *cobra.Command {
	var tenant, since string
	c := &cobra.Command{
		Use:   "usage [--tenant TENANT_ID] [--since TIME]",
		Short: "Show GPU-seconds per reservation and hour, with their total",
		Long: "usage lists the usage windows of your tenant (or of --tenant, with a root-admin token): the\n" +
			"GPU-seconds each reservation used in each hour. --since (RFC 3339) keeps the windows ending after it.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&tenant, "tenant", "", "tenant id (default: your token's tenant)")
	_ = c.RegisterFlagCompletionFunc("tenant", a.completeTenantIDs)
	c.Flags().StringVar(&since, "since", "", "only windows ending after this RFC 3339 time")
	format := addOutputFlag(c)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		req := &computev1.ListUsageRequest{TenantId: tenant}
		if since != "" {
			t, err := time.Parse(time.RFC3339, since)
			if err != nil {
				return fmt.Errorf("--since: want an RFC 3339 time such as 2025-03-01T10:00:00Z: %w", err)
			}
			req.Since = timestamppb.New(t)
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		res, err := cl.usage.ListUsage(cmd.Context(), connect.NewRequest(req))
		if err != nil {
			return err
		}
		type windowJSON struct {
			Reservation string    `json:"reservation"`
			Tenant      string    `json:"tenant"`
			Pool        string    `json:"pool"`
			WindowStart time.Time `json:"windowStart"`
			GPUSeconds  int64     `json:"gpuSeconds"`
		}
		out := struct {
			Windows         []windowJSON `json:"windows"`
			TotalGPUSeconds int64        `json:"totalGpuSeconds"`
		}{Windows: make([]windowJSON, len(res.Msg.Windows)), TotalGPUSeconds: res.Msg.TotalGpuSeconds}
		rows := make([][]string, 0, len(res.Msg.Windows)+1)
		for i, w := range res.Msg.Windows {
			out.Windows[i] = windowJSON{Reservation: w.ReservationId, Tenant: w.TenantId, Pool: w.PoolId,
				WindowStart: w.WindowStart.AsTime().UTC(), GPUSeconds: w.GpuSeconds}
			rows = append(rows, []string{w.WindowStart.AsTime().UTC().Format(time.RFC3339), w.ReservationId, w.PoolId,
				strconv.FormatInt(w.GpuSeconds, 10), gpuHours(w.GpuSeconds)})
		}
		if *format == formatJSON {
			return writeJSON(a.env.Stdout, out)
		}
		rows = append(rows, []string{"TOTAL", "", "", strconv.FormatInt(res.Msg.TotalGpuSeconds, 10), gpuHours(res.Msg.TotalGpuSeconds)})
		return table(a.env.Stdout, []string{"WINDOW", "RESERVATION", "POOL", "GPU-SECONDS", "GPU-HOURS"}, rows)
	}
	return a.fields(c, map[string]string{"tenant_id": "--tenant", "since": "--since"})
}

// gpuHours renders GPU-seconds as GPU-hours with two decimals.
func gpuHours(secs int64) string {
	return strconv.FormatFloat(float64(secs)/3600, 'f', 2, 64)
}
