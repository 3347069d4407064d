package api

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
)

// defaultUsagePageSize is ListUsage's page size when the request names none.
const defaultUsagePageSize = 1000

type usageService struct{ *Server }

// ListUsage lists the usage windows (GPU-seconds per reservation and hour)
// of tenant_id (default: the caller's; another tenant's needs root-admin),
// those ending after since when it is set, by window start, then
// reservation id; at most page_size windows (default 1000). The windows are
// those the controllers' usage sink wrote (final), and those it has not
// written yet (store.OpenUsage): of the running (binding or active)
// reservations up to now, the current hour so far, so that a running
// reservation counts from its start; of the ended ones up to their end, so
// that a reservation's usage does not drop between its end and the sink's
// next pass. total_gpu_seconds sums the windows listed.
// Errors: NotFound (tenant_id), InvalidArgument (since).
func (s *usageService) ListUsage(ctx context.Context, req *connect.Request[computev1.ListUsageRequest]) (*connect.Response[computev1.ListUsageResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	scope, err := s.tenantFor(ctx, s.db.Pool, p, msg.TenantId)
	if err != nil {
		return nil, mapError(err)
	}
	f := store.UsageFilter{Scope: scope, Limit: int(msg.PageSize)}
	if f.Limit == 0 {
		f.Limit = defaultUsagePageSize
	}
	if msg.Since != nil {
		if err := msg.Since.CheckValid(); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("since: %w", err))
		}
		f.Since = msg.Since.AsTime()
	}
	windows, err := store.ListUsage(ctx, s.db.Pool, f)
	if err != nil {
		return nil, mapError(err)
	}
	open, err := store.OpenUsage(ctx, s.db.Pool, f, s.db.Now())
	if err != nil {
		return nil, mapError(err)
	}
	windows = append(windows, open...)
	slices.SortStableFunc(windows, func(a, b store.UsageWindow) int {
		if c := a.WindowStart.Compare(b.WindowStart); c != 0 {
			return c
		}
		return strings.Compare(a.ReservationID, b.ReservationID)
	})
	windows = windows[:min(len(windows), f.Limit)]
	res := &computev1.ListUsageResponse{Windows: make([]*computev1.UsageWindow, len(windows))}
	for i, w := range windows {
		res.Windows[i] = &computev1.UsageWindow{ReservationId: w.ReservationID, TenantId: w.TenantID, PoolId: w.PoolID,
			WindowStart: timestamppb.New(w.WindowStart), GpuSeconds: w.GPUSeconds}
		res.TotalGpuSeconds += w.GPUSeconds
	}
	return connect.NewResponse(res), nil
}
