package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
)

// Reconnection delays of `events watch`: the first after a dropped stream,
// doubling up to the most while no stream is established; once one is (its
// response headers arrived), the next drop waits watchRetryFirst again.
const (
	watchRetryFirst = 500 * time.Millisecond
	watchRetryMost  = 10 * time.Second
)

func (a *app) eventsCmd() *cobra.Command {
	c := &cobra.Command{Use: "events", Short: "Watch the events of your tenant (every tenant's with a root-admin token)"}
	c.AddCommand(a.eventsWatchCmd())
	return c
}

// eventJSON is one line of `events watch`, the shape of GET
// /api/compute/watch's lines.
type eventJSON struct {
	ID        int64           `json:"id"`
	Type      string          `json:"type"`
	TenantID  string          `json:"tenantId"`
	SubjectID string          `json:"subjectId"`
	Data      json.RawMessage `json:"data"`
	Time      time.Time       `json:"time"`
}

func (a *app) eventsWatchCmd() *cobra.Command {
	var (
		types     string
		after     int64
		fromStart bool
	)
	c := &cobra.Command{
		Use:   "watch [--types node.*,reservation.*] [--after ID | --from-start]",
		Short: "Print events as they happen, one JSON object per line",
		Long: "Print events as they happen, one JSON object per line ({id, type, tenantId, subjectId, data, time}),\n" +
			"oldest first, of your tenant (every tenant's for a root-admin). --after ID starts after the event\n" +
			"with that id (an id above the newest of those events is refused), --from-start with the oldest\n" +
			"event retained (default: from now). --types takes exact\n" +
			"types and families (node.*, command.*, reservation.*); a pattern that matches no event type is\n" +
			"refused. When the stream drops, the command reconnects and resumes after the last event printed,\n" +
			"with no gap and no duplicate. Before the first event printed, it resumes after the id the stream\n" +
			"started after, which the server names in the Bc-Watch-After response header (the --after ID, or\n" +
			"the newest id of those events when a watch from now started), or from the start when that is 0\n" +
			"(there was no event yet, or --from-start). It runs until interrupted, or until the server\n" +
			"refuses to resume because retention removed events after the last one printed (it then says\n" +
			"to use --from-start, which replays the events kept).\n\n" +
			"The same stream over HTTP: curl -N -H \"Authorization: Bearer $BETTER_COMPUTE_TOKEN\"\n" +
			"\"$BETTER_COMPUTE_URL/api/compute/watch?types=node.*&after=ID\" (NDJSON; parameters types, after,\n" +
			"from_start; an error that ends the stream is a last line {\"code\": …, \"message\": …}).\n\n" +
			"Event types: " + strings.Join(store.EventTypes, ", ") + ".",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&types, "types", "", "comma-separated type patterns: exact (node.cordoned) or family (node.*); empty entries are ignored; default: all")
	_ = c.RegisterFlagCompletionFunc("types", completeList(append(store.EventFamilies(), store.EventTypes...)...))
	c.Flags().Int64Var(&after, "after", 0, "start after the event with this id")
	c.Flags().BoolVar(&fromStart, "from-start", false, "replay every retained event, oldest first, then go on live")
	c.MarkFlagsMutuallyExclusive("after", "from-start")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if after < 0 {
			return errors.New("--after must be an event id (≥ 0)")
		}
		req := &computev1.WatchRequest{AfterId: after, FromStart: fromStart}
		for _, t := range strings.Split(types, ",") {
			if t = strings.TrimSpace(t); t != "" {
				req.Types = append(req.Types, t)
			}
		}
		token, err := a.apiToken()
		if err != nil {
			return err
		}
		base, err := a.baseURL()
		if err != nil {
			return err
		}
		// No client timeout: the stream lasts until interrupted.
		client := computev1connect.NewEventServiceClient(&http.Client{}, base+apiPath,
			connect.WithInterceptors(lostConnection{}, streamHeaders{token: token, tenant: a.env.Getenv("BETTER_COMPUTE_TENANT")}))
		return a.watchEvents(cmd.Context(), client, req)
	}
	return a.fields(c, map[string]string{"types": "--types", "after_id": "--after", "from_start": "--from-start"})
}

// watchEvents prints the events of req's watch, reconnecting after a
// dropped stream from the last id printed (watchOnce moves req), until ctx
// ends (nil) or the API refuses the watch (its error; FailedPrecondition,
// retention removed events after the cursor, with a hint to use
// --from-start). The delay before a
// reconnect doubles from watchRetryFirst up to watchRetryMost while no
// stream is established, and starts again from watchRetryFirst after one
// was, whether or not it delivered an event: a quiet filtered watch is as
// quick to come back as a busy one.
func (a *app) watchEvents(ctx context.Context, client computev1connect.EventServiceClient, req *computev1.WatchRequest) error {
	enc := json.NewEncoder(a.env.Stdout)
	delay := watchRetryFirst
	for {
		established, err := a.watchOnce(ctx, client, req, enc)
		if ctx.Err() != nil {
			return nil
		}
		switch connect.CodeOf(err) {
		case connect.CodeUnauthenticated, connect.CodePermissionDenied, connect.CodeInvalidArgument:
			return err
		case connect.CodeFailedPrecondition:
			// Retention removed events after the cursor: resuming would
			// skip them, so the watch stops and says how to go on.
			var cerr *connect.Error
			if errors.As(err, &cerr) {
				hinted := connect.NewError(cerr.Code(), errors.New(cerr.Message()+
					" (run `better-compute events watch --from-start` to replay the events kept)"))
				return hinted
			}
			return err
		}
		if established {
			delay = watchRetryFirst
		}
		reason := "the stream ended"
		if err != nil {
			reason = err.Error()
		}
		fmt.Fprintf(a.env.Stderr, "events watch: %s; resuming %s in %s\n", reason, resumePoint(req), delay)
		if err := clock.Sleep(ctx, a.env.Clock, delay); err != nil {
			return nil
		}
		delay = min(2*delay, watchRetryMost)
	}
}

// watchCursorHeader is api.WatchCursorHeader: the id a watch starts after.
const watchCursorHeader = "Bc-Watch-After"

// watchOnce runs one Watch call, printing each event and moving
// req.AfterId past it (and clearing req.FromStart); established reports
// whether the stream was established: its response headers arrived, with
// the Bc-Watch-After header the API sends once the watch has its cursor
// (a refusal or a failure before that has none). A watch "from now" takes
// its starting id from that header, once the stream has delivered an event
// or ended: 0 there (no event yet when it started) makes it a watch from
// the start, since after_id 0 would mean "from now" again and skip what was
// written meanwhile.
func (a *app) watchOnce(ctx context.Context, client computev1connect.EventServiceClient, req *computev1.WatchRequest,
	enc *json.Encoder,
) (established bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Watch(ctx, connect.NewRequest(req))
	if err != nil {
		return false, err
	}
	defer stream.Close()
	// A watch "from now" (after 0, not from the start) learns from the
	// response header where now was, so that a reconnect before the first
	// event resumes from there.
	started := false
	start := func() {
		if started {
			return
		}
		started = true
		c, err := strconv.ParseInt(stream.ResponseHeader().Get(watchCursorHeader), 10, 64)
		if err != nil {
			return // the stream ended before its headers
		}
		established = true
		if req.AfterId == 0 && !req.FromStart {
			req.AfterId, req.FromStart = c, c == 0
		}
	}
	for stream.Receive() {
		start()
		e := stream.Msg().GetEvent()
		data := json.RawMessage(e.DataJson)
		if len(data) == 0 {
			data = json.RawMessage("{}")
		}
		if err := enc.Encode(eventJSON{ID: e.Id, Type: e.Type, TenantID: e.TenantId, SubjectID: e.SubjectId, Data: data,
			Time: e.Time.AsTime().UTC()}); err != nil {
			return established, err
		}
		req.AfterId, req.FromStart = e.Id, false
	}
	// Receive returned false: the headers, if any, have arrived.
	start()
	return established, stream.Err()
}

// streamHeaders sets the bearer token and X-BC-Tenant on streaming calls
// (the unary clients of client.go set them with a unary interceptor).
type streamHeaders struct{ token, tenant string }

func (h streamHeaders) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc { return next }

func (h streamHeaders) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", "Bearer "+h.token)
		if h.tenant != "" {
			conn.RequestHeader().Set("X-BC-Tenant", h.tenant)
		}
		return conn
	}
}

func (h streamHeaders) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// resumePoint says where a watch with req starts: after an id, from the
// oldest retained event, or from now (after_id 0, before any stream told
// it where it started).
func resumePoint(req *computev1.WatchRequest) string {
	switch {
	case req.FromStart:
		return "from the oldest retained event"
	case req.AfterId == 0:
		return "from now (no stream has started yet)"
	}
	return fmt.Sprintf("after event %d", req.AfterId)
}
