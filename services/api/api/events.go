package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"buf.build/go/protovalidate"
	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ratelimit"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
)

// WatchPath is the NDJSON events route (GET, under PathPrefix):
// ?types=node.*,reservation.active&after=ID (or from_start=true instead of
// after), one JSON object per line.
const WatchPath = PathPrefix + "/watch"

// WatchConfig tunes the events watch (EventService.Watch and WatchPath);
// zero fields take the defaults.
//
// Event ids are bigserial: taken at insert, visible at commit, so a later id
// can commit before an earlier one, and a rolled-back insert leaves a gap
// that never fills. A watcher delivers strictly by id and never steps over
// an id that may still commit. It reads only its caller's tenant's events
// (every tenant's for a root administrator), so it cannot see the ids
// between them; instead each read comes with the transactions running at
// its snapshot (store.EventScan: those it lists, and those from its xmax
// on, which it does not). An event id is taken after its transaction's id
// (migration 000017), so an event below one read that may still commit
// belongs to one of them; and a transaction that inserted events holds a
// lock on the table until it ends (store.ScanWriters, EventWriters). A
// read is delivered at once when none of them may write events and none
// has ended since (none was running, or they are another database's or
// never touched events); otherwise the watch holds it, and once none of
// them may write events it reads again and delivers the events up to the
// highest id held. A hold is checked again at each hint a commit that
// wrote events publishes (store.SubjectEvents, of any tenant, published by
// the writer right after its commit: the transaction held for may be the
// one that ended), after GapRecheck, doubling up to Poll (for a transaction
// that rolls back, which sends no hint), and at every wake and poll; it ends at the latest after
// MaxGrace, so that a long transaction cannot stall every watch (an event
// whose transaction outlives MaxGrace is then not delivered to watches
// that were live; a watch resumed later does get it).
type WatchConfig struct {
	// Poll is how often a watch reads the events table when NATS wakes it
	// for nothing (the backstop; default 1 s).
	Poll time.Duration
	// MaxGrace is the most time events are held for transactions that
	// were running when they were read (default 1 min).
	MaxGrace time.Duration
	// GapRecheck is how soon a watch holding events checks again whether
	// it may deliver them, doubling at every check that does not let it,
	// up to Poll (default 50 ms, at most Poll).
	GapRecheck time.Duration
	// Batch is how many events one read returns, which bounds a watch's
	// memory (default 500).
	Batch int
	// AuthCheck is how often an open watch authenticates its caller's
	// token again (default 1 s, the token cache's TTL, so that a check
	// costs a query at most once per TTL): a watch whose token was revoked
	// ends within about AuthCheck. A watch also ends at its token's expiry.
	AuthCheck time.Duration
	// LimitPerToken is how many events watches (EventService.Watch and
	// GET /api/compute/watch together) one API token may hold open on this
	// API server at once; one more is refused with ResourceExhausted (HTTP
	// 429) until one of them ends.
	LimitPerToken int `env:"WATCH_LIMIT_PER_TOKEN,positive" default:"16"`
}

func (c WatchConfig) withDefaults() WatchConfig {
	if c.Poll <= 0 {
		c.Poll = time.Second
	}
	if c.MaxGrace <= 0 {
		c.MaxGrace = time.Minute
	}
	if c.GapRecheck <= 0 {
		c.GapRecheck = 50 * time.Millisecond
	}
	c.GapRecheck = min(c.GapRecheck, c.Poll)
	if c.Batch <= 0 {
		c.Batch = 500
	}
	if c.AuthCheck <= 0 {
		c.AuthCheck = time.Second
	}
	if c.LimitPerToken <= 0 {
		c.LimitPerToken = 16
	}
	return c
}

// watchSlots counts the open watches of each token (WatchConfig
// LimitPerToken). Its zero value is ready.
type watchSlots struct {
	mu   sync.Mutex
	open map[string]int
}

// take claims a watch slot of token, or reports false when it has limit
// open already; release gives it back.
func (w *watchSlots) take(token string, limit int) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.open[token] >= limit {
		return false
	}
	if w.open == nil {
		w.open = make(map[string]int)
	}
	w.open[token]++
	return true
}

func (w *watchSlots) release(token string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.open[token]--; w.open[token] <= 0 {
		delete(w.open, token)
	}
}

type eventService struct{ *Server }

// Watch streams the events of the caller's tenant (every tenant's for
// root-admin) whose type matches req.Types, after req.AfterId (0: from the
// newest committed event; with req.FromStart: every retained event), oldest
// first, then each new one as it commits
// (WatchConfig says how gaps in the ids are handled). It refuses
// (InvalidArgument) a type pattern that matches none of store.EventTypes
// ("types[i]: …") and an after_id above the newest committed event id of
// the caller's tenant ("after_id: …", naming that id; every tenant's for
// root-admin); it refuses (FailedPrecondition, "after_id: events after N
// were removed by retention (the oldest event id kept is M) …", the ids of
// the caller's scope only) an after_id below the highest id retention
// removed of the caller's events, and ends a watch so far behind that
// retention removes events after its cursor likewise: resume with
// from_start (docs/architecture.md, "Retention"). It refuses a token that
// holds WatchConfig.LimitPerToken watches open already (ResourceExhausted). It ends when the
// client cancels (no error), the server shuts down or the database cannot
// be reached (Unavailable: resume with the last id received), or the
// caller's token is revoked or expires (Unauthenticated "api token was
// revoked" / "api token expired at …"; checked every WatchConfig.AuthCheck
// and at the expiry).
func (s *eventService) Watch(ctx context.Context, req *connect.Request[computev1.WatchRequest], stream *connect.ServerStream[computev1.WatchResponse]) error {
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	// A watch lasts; each of its writes is bounded (service.BoundWrite).
	service.LongLived(ctx)
	// Send(nil) sends the response headers: the watch has its cursor.
	ready := func(cursor int64) error {
		stream.ResponseHeader().Set(WatchCursorHeader, strconv.FormatInt(cursor, 10))
		defer service.BoundWrite(ctx)()
		return stream.Send(nil)
	}
	send := func(e store.Event) error {
		defer service.BoundWrite(ctx)()
		return stream.Send(&computev1.WatchResponse{Event: &computev1.Event{Id: e.ID, Type: e.Type, TenantId: e.TenantID,
			SubjectId: e.SubjectID, DataJson: string(e.Data), Time: timestamppb.New(e.CreatedAt)}})
	}
	// The shared interceptor (service.HandlerOptions) masks internal errors.
	return s.watch(ctx, p, req.Header().Get("Authorization"), watchRequest{types: req.Msg.Types, after: req.Msg.AfterId,
		fromStart: req.Msg.FromStart, afterName: "after_id"}, ready, send)
}

// watchEventJSON is one line of WatchPath: an events row.
type watchEventJSON struct {
	ID        int64           `json:"id"`
	Type      string          `json:"type"`
	TenantID  string          `json:"tenantId"`
	SubjectID string          `json:"subjectId"`
	Data      json.RawMessage `json:"data"`
	Time      time.Time       `json:"time"`
}

// serveWatch serves GET WatchPath: the events watch as NDJSON
// (application/x-ndjson), one event per line, flushed per event, with the
// semantics of EventService.Watch. types is a comma-separated list of
// patterns and may be repeated (types=node.*&types=reservation.active,
// command.*): the watch takes every pattern of every types parameter, and
// they are numbered in that order in refusals (types[2]). Empty entries
// ("node.*,,command.*", a trailing comma, types=) are dropped, so that no
// pattern at all (types= alone) watches every type, as no types parameter
// does; after is the id of the last event received (above the newest
// event id: refused, naming after); from_start=true (a Go
// boolean: true, false, 1, 0, …) replays every retained event and may not
// come with a non-zero after. Refusals are JSON
// objects {"code": "...", "message": "..."} with 401 (missing or bad
// token), 429 with Retry-After (the address failed to authenticate too
// often) or without (the token holds WatchConfig.LimitPerToken watches
// already), 403 (role without events.read), 400 (bad query parameter, named),
// 410 (code failed_precondition: after is below what retention removed;
// watch again with from_start), 503 (database unreachable: retry) or 500.
// Once the response has begun (200), an error ends it with one last line of that shape, which has no
// "id": {"code": "unavailable", …} when the server shuts down or the
// database cannot be reached (resume with the last id), {"code":
// "unauthenticated", "message": "api token was revoked"} (or "… expired
// at …") when the token no longer authenticates (checked every
// WatchConfig.AuthCheck and at its expiry), {"code": "internal", "message":
// "internal error"} otherwise.
func (s *Server) serveWatch(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	authorization := r.Header.Get("Authorization")
	p, err := s.authn.AuthenticateFrom(ctx, authorization, ratelimit.Source(r.RemoteAddr, r.Header, s.cfg.TrustForwardedFor))
	var throttled *iam.ThrottledError
	switch {
	case errors.Is(err, iam.ErrUnauthenticated):
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, err.Error())
		return
	case errors.As(err, &throttled):
		s.writeStreamError(w, r, "watch", false, iam.AuthError(err))
		return
	case err != nil:
		s.writeStreamError(w, r, "watch", false, fmt.Errorf("authenticate: %w", err))
		return
	case !p.Can(iam.PermEventsRead):
		writeHTTPError(w, http.StatusForbidden, connect.CodePermissionDenied,
			"role "+string(p.Role)+" may not watch events (needs "+string(iam.PermEventsRead)+")")
		return
	}
	req, err := parseWatchQuery(r.URL.Query())
	if err != nil {
		msg := err.Error()
		var cerr *connect.Error
		if errors.As(err, &cerr) {
			msg = cerr.Message()
		}
		writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument, msg)
		return
	}
	// A watch lasts; each of its writes is bounded (service.BoundWrite).
	service.LongLived(ctx)
	rc := http.NewResponseController(w)
	ready := func(cursor int64) error {
		w.Header().Set(WatchCursorHeader, strconv.FormatInt(cursor, 10))
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Accel-Buffering", "no") // proxies: do not buffer
		w.WriteHeader(http.StatusOK)
		defer service.BoundWrite(ctx)()
		return rc.Flush()
	}
	enc := json.NewEncoder(w)
	send := func(e store.Event) error {
		defer service.BoundWrite(ctx)()
		if err := enc.Encode(watchEventJSON{ID: e.ID, Type: e.Type, TenantID: e.TenantID, SubjectID: e.SubjectID,
			Data: e.Data, Time: e.CreatedAt.UTC()}); err != nil {
			return err
		}
		return rc.Flush()
	}
	started := false
	err = s.watch(ctx, p, authorization, watchRequest{types: req.Types, after: req.AfterId, fromStart: req.FromStart,
		afterName: "after"}, func(cursor int64) error { started = true; return ready(cursor) }, send)
	if err != nil && ctx.Err() == nil {
		s.writeStreamError(w, r, "watch", started, err)
	}
}

// parseWatchQuery reads the query parameters of GET WatchPath (serveWatch
// gives their form: types, after, from_start) into a WatchRequest, checked
// by protovalidate (computev1.WatchRequest's rules) but not yet against the
// events (watch). Refusals are InvalidArgument errors whose message names
// the parameter.
func parseWatchQuery(q url.Values) (*computev1.WatchRequest, error) {
	invalid := func(msg string) error { return connect.NewError(connect.CodeInvalidArgument, errors.New(msg)) }
	req := &computev1.WatchRequest{}
	for _, list := range q["types"] {
		for _, t := range strings.Split(list, ",") {
			if t = strings.TrimSpace(t); t != "" {
				req.Types = append(req.Types, t)
			}
		}
	}
	for _, name := range []string{"after", "from_start"} {
		if len(q[name]) > 1 {
			return nil, invalid(name + ": given more than once")
		}
	}
	var err error
	if a := q.Get("after"); a != "" {
		if req.AfterId, err = strconv.ParseInt(a, 10, 64); err != nil || req.AfterId < 0 {
			return nil, invalid("after: want an event id (an integer ≥ 0)")
		}
	}
	if q.Has("from_start") {
		if req.FromStart, err = strconv.ParseBool(q.Get("from_start")); err != nil {
			return nil, invalid("from_start: want true or false")
		}
		if req.FromStart && req.AfterId != 0 {
			return nil, invalid("from_start: cannot be combined with after=" + strconv.FormatInt(req.AfterId, 10))
		}
	}
	if err := protovalidate.Validate(req); err != nil {
		return nil, invalid(service.ViolationsText(err))
	}
	return req, nil
}

// writeStreamError tells the client of GET WatchPath (what "watch") what
// ended its watch, as a JSON error response or, once the response has
// started, as its last line (serveWatch), masked by service.PublicError (the
// real error is logged); the tunnels (what "tunnel") use it before their
// WebSocket.
func (s *Server) writeStreamError(w http.ResponseWriter, r *http.Request, what string, started bool, err error) {
	defer service.BoundWrite(r.Context())() // a watch's last line
	public, masked := service.PublicError(err)
	code := connect.CodeOf(public)
	switch {
	case masked && code == connect.CodeUnavailable:
		s.logger.WarnContext(r.Context(), what+": database unavailable", "err", err)
	case masked:
		s.logger.ErrorContext(r.Context(), what, "err", err)
	}
	msg := public.Error()
	var cerr *connect.Error
	if errors.As(public, &cerr) {
		msg = cerr.Message()
	}
	if !started {
		status := http.StatusInternalServerError
		switch code {
		case connect.CodeInvalidArgument:
			status = http.StatusBadRequest
		case connect.CodeFailedPrecondition:
			status = http.StatusGone // the events after the cursor are gone
		case connect.CodeUnavailable:
			status = http.StatusServiceUnavailable
		case connect.CodeUnauthenticated:
			status = http.StatusUnauthorized
		case connect.CodeResourceExhausted:
			status = http.StatusTooManyRequests
		}
		if cerr != nil {
			if retry := cerr.Meta().Get(ratelimit.RetryAfterHeader); retry != "" {
				w.Header().Set(ratelimit.RetryAfterHeader, retry)
			}
		}
		writeHTTPError(w, status, code, msg)
		return
	}
	if json.NewEncoder(w).Encode(map[string]string{"code": code.String(), "message": msg}) == nil {
		_ = http.NewResponseController(w).Flush() // the client may be gone
	}
}

// writeHTTPError writes a JSON error {"code": "...", "message": "..."} with
// status, codes as Connect names them ("unauthenticated").
func writeHTTPError(w http.ResponseWriter, status int, code connect.Code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"code": code.String(), "message": msg})
}

// WatchCursorHeader is the response header of both watch paths that names
// the id the watch starts after: the request's after_id, the newest id of
// the caller's tenant's events (of every tenant's for root-admin: never
// another tenant's) when it asked for events "from now" (after_id 0), or 0
// with from_start. A client that loses the stream before any event resumes
// after it, so that nothing committed meanwhile is missed; after 0 it
// resumes with from_start (a watch from now that says 0 began when its
// tenant had no event: every event retained since is new to it), as
// after_id 0 would mean "from now" again.
const WatchCursorHeader = "Bc-Watch-After"

// commitSignal tells the watches holding events that a transaction that
// wrote events has committed (the hints on store.SubjectEvents). Its zero
// value is ready.
type commitSignal struct {
	mu sync.Mutex
	// ch is closed at the next signal; nil until a watch waits.
	ch chan struct{}
}

// wait returns a channel closed at the next signal.
func (c *commitSignal) wait() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ch == nil {
		c.ch = make(chan struct{})
	}
	return c.ch
}

// signal closes the channel of the watches waiting, if any; it never
// blocks.
func (c *commitSignal) signal() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ch != nil {
		close(c.ch)
		c.ch = nil
	}
}

// gapHold is what a watch holds back until the transactions running at a
// read have ended (WatchConfig).
type gapHold struct {
	// seen is when the events were first held.
	seen time.Time
	// running are the transactions that may hold ids below upTo
	// (store.ScanWriters' held: those running at that read, whether or
	// not its snapshot listed them): once none of them may write events
	// (store.EventWriters), a read of the ids up to upTo is final.
	running []int64
	// upTo is the highest id that read returned: the ids up to it are
	// final once the hold passes.
	upTo int64
	// recheck is the wait before the next check (GapRecheck, doubling).
	recheck time.Duration
}

// readNext is when a watch reads the events table again, as step decides.
type readNext int

const (
	// readOnWake: caught up; read at the next wake (NATS) or poll.
	readOnWake readNext = iota
	// readNow: read again at once: the read was full.
	readNow
	// readOnRecheck: events are held; check them again after
	// recheckDelay, or at a wake or poll if one comes first.
	readOnRecheck
)

// watcher is one watch's position.
type watcher struct {
	s   *Server
	cfg WatchConfig
	// p is the caller, authorization its Authorization header, which
	// recheck authenticates again.
	p             iam.Principal
	authorization string
	filter        store.EventFilter
	// cursor is the id after which the next read starts: the last id
	// delivered (or stepped over after MaxGrace), or where the watch began.
	cursor int64
	hold   *gapHold
	// afterName names the cursor in refusals (watchRequest.afterName).
	afterName string
	// fromStart is true while a watch from the start has delivered
	// nothing: what retention removes before its first event is not lost
	// to it.
	fromStart bool
}

// checkRetained refuses (FailedPrecondition, naming afterName and the
// oldest event id kept of the caller's scope) a cursor after below the
// highest id retention removed of the caller's scope (store.EventRetention):
// events the client never received after it are gone. Both ids are the
// scope's own (a tenant's events, every tenant's for root-admin), never
// another tenant's.
func (w *watcher) checkRetained(ctx context.Context, after int64) error {
	removed, oldest, err := store.EventRetention(ctx, w.s.db.Pool, w.filter.Scope)
	if err != nil || after >= removed {
		return err
	}
	return w.removedError(after, oldest)
}

// removedError is checkRetained's refusal of cursor after, oldest the
// oldest event id kept of the scope (0: none).
func (w *watcher) removedError(after, oldest int64) error {
	kept := "no event is kept"
	if oldest != 0 {
		kept = fmt.Sprintf("the oldest event id kept is %d", oldest)
	}
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf(
		"%s: events after %d were removed by retention (%s): watch again from the start (from_start)",
		w.afterName, after, kept))
}

// watchRequest is what a watch asks for, checked by protovalidate
// (computev1.WatchRequest's rules) but not yet against the events.
type watchRequest struct {
	// types are the type patterns (store.EventFilter.Types).
	types []string
	// after is the id to resume after; 0 for none.
	after int64
	// fromStart replays every retained event (after is then 0).
	fromStart bool
	// afterName names after in refusals: "after_id" (EventService.Watch)
	// or "after" (WatchPath).
	afterName string
}

// watch runs one watch for p, who authenticated with the Authorization
// header value authorization: it checks req (InvalidArgument: a type
// pattern that matches no event type, an after above the newest event id),
// takes one of the token's watch slots (ResourceExhausted when it has
// WatchConfig.LimitPerToken), fixes the cursor (req.after; 0 with
// req.fromStart, so that every retained event comes; otherwise the newest
// committed id of p's scope when req.after is 0),
// calls ready, then calls send for every
// matching event in id order until ctx ends (nil), the server stops
// (Unavailable), send fails (its error), the database does (Internal, or
// Unavailable when it cannot be reached: service.PublicError), or the
// caller no longer authenticates (Unauthenticated; recheck, every
// WatchConfig.AuthCheck and at p.ExpiresAt).
func (s *Server) watch(ctx context.Context, p iam.Principal, authorization string, req watchRequest,
	ready func(cursor int64) error, send func(store.Event) error,
) error {
	if err := checkTypePatterns(req.types); err != nil {
		return err
	}
	w := &watcher{s: s, cfg: s.cfg.Watch.withDefaults(), p: p, authorization: authorization,
		filter: store.EventFilter{Scope: p.Scope(), Types: req.types}, cursor: req.after, afterName: req.afterName,
		fromStart: req.fromStart}
	if !s.watches.take(p.TokenID, w.cfg.LimitPerToken) {
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
			"this API token has %d events watches open on this server, the most it may: end one first", w.cfg.LimitPerToken))
	}
	defer s.watches.release(p.TokenID)
	if req.after != 0 {
		// What retention removed of the caller's own events: a resume
		// below it would skip events the client never received.
		if err := w.checkRetained(ctx, req.after); err != nil {
			return w.end(ctx, err)
		}
		// The newest of the caller's own events (all for root): what
		// another tenant wrote is none of its business, not even the ids.
		newest, err := store.MaxEventID(ctx, s.db.Pool, w.filter.Scope)
		if err != nil {
			return w.end(ctx, err)
		}
		// A client resumes only after ids it received, and every one was
		// committed before it was sent, so it is at most newest even when
		// more ids commit between the client's read and ours: a higher one
		// is a mistake (a typo, an id of another deployment, a database
		// restored from an older backup), and a watch after it would wait,
		// silently, for ids this database has not reached.
		if req.after > newest {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(
				"%s: %d is above the newest event id, %d: resume after an id this API sent (0 watches from now)",
				req.afterName, req.after, newest))
		}
	}
	wake := make(chan struct{}, 1)
	if s.nc != nil {
		// The writer of events of the tenant publishes a hint after its
		// commit: read now rather than at the next poll.
		subject := store.SubjectEvents + ".>"
		if tenant := w.filter.Scope.Tenant(); tenant != "" {
			subject = store.SubjectEvents + "." + tenant + ".>"
		}
		sub, err := s.nc.Subscribe(subject, func(*nats.Msg) {
			select {
			case wake <- struct{}{}:
			default:
			}
		})
		if err != nil {
			s.logger.WarnContext(ctx, "watch: subscribe to events; polling only", "err", err)
		} else {
			defer func() { _ = sub.Unsubscribe() }()
		}
	}
	if req.after == 0 && !req.fromStart {
		id, err := store.MaxEventID(ctx, s.db.Pool, w.filter.Scope)
		if err != nil {
			return w.end(ctx, err)
		}
		w.cursor = id
	}
	if err := ready(w.cursor); err != nil {
		return w.end(ctx, err)
	}
	ticker := s.clock.NewTicker(w.cfg.Poll)
	defer ticker.Stop()
	authTick := s.clock.NewTicker(w.cfg.AuthCheck)
	defer authTick.Stop()
	var expiry <-chan time.Time // fires at p.ExpiresAt
	if p.ExpiresAt != nil {
		t := s.clock.NewTimer(max(0, p.ExpiresAt.Sub(s.clock.Now())))
		defer t.Stop()
		expiry = t.C()
	}
	recheckTimer := s.clock.NewTimer(w.cfg.Poll) // armed while a gap is held
	recheckTimer.Stop()
	defer recheckTimer.Stop()
	for {
		// Taken before the read, so that a commit between the read and the
		// wait is not missed.
		committed := s.commits.wait()
		next, err := w.step(ctx, send)
		if err != nil {
			return w.end(ctx, err)
		}
		if next == readNow {
			if ctx.Err() != nil {
				return nil
			}
			// A long catch-up checks the token as often as an idle watch.
			select {
			case <-authTick.C():
			case <-expiry:
				expiry = nil
			default:
				continue
			}
			if err := w.recheck(ctx); err != nil {
				return w.end(ctx, err)
			}
			continue
		}
		var recheck <-chan time.Time
		var commit <-chan struct{} // a commit's poke, while events are held
		if next == readOnRecheck {
			recheckTimer.Reset(w.recheckDelay())
			recheck = recheckTimer.C()
			commit = committed
		}
	wait:
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-s.stopWatches:
				return connect.NewError(connect.CodeUnavailable, errors.New("the server is shutting down: resume after the last event id"))
			case <-wake:
				break wait
			case <-ticker.C():
				break wait
			case <-recheck:
				break wait
			case <-commit:
				break wait
			case <-authTick.C():
			case <-expiry:
				expiry = nil
			}
			if err := w.recheck(ctx); err != nil {
				return w.end(ctx, err)
			}
		}
		recheckTimer.Stop()
		select { // a fake clock's timer may have fired meanwhile
		case <-recheckTimer.C():
		default:
		}
	}
}

// checkTypePatterns refuses (InvalidArgument, naming types[i]) a type
// pattern that matches none of the event types the control plane writes
// (store.EventPatternKnown): such a watch would never deliver anything.
func checkTypePatterns(types []string) error {
	for i, t := range types {
		if !store.EventPatternKnown(t) {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(
				"types[%d]: %q matches no event type (every event type is in one of the families %s)",
				i, t, strings.Join(store.EventFamilies(), ", ")))
		}
	}
	return nil
}

// recheckDelay is how long a watch holding events waits before it checks
// them again (WatchConfig): hold.recheck, which doubles up to Poll; never
// past MaxGrace.
func (w *watcher) recheckDelay() time.Duration {
	h := w.hold
	held := clock.Since(w.s.clock, h.seen)
	d := h.recheck
	h.recheck = min(2*d, w.cfg.Poll)
	return max(0, min(d, w.cfg.MaxGrace-held))
}

// recheck authenticates the watch's caller again: an Unauthenticated error
// once its token has expired (by the server's clock) or no longer
// authenticates (revoked, deleted); nil otherwise, also when the database
// failed (logged; the next check retries), so that a passing database
// error does not end every watch.
func (w *watcher) recheck(ctx context.Context) error {
	if exp := w.p.ExpiresAt; exp != nil && !exp.After(w.s.clock.Now()) {
		return connect.NewError(connect.CodeUnauthenticated,
			errors.New("api token expired at "+exp.UTC().Format(time.RFC3339)))
	}
	_, err := w.s.authn.Authenticate(ctx, w.authorization)
	switch {
	case errors.Is(err, iam.ErrUnauthenticated):
		return connect.NewError(connect.CodeUnauthenticated, err)
	case err != nil && ctx.Err() == nil:
		w.s.logger.WarnContext(ctx, "watch: authenticate again; retrying at the next check", "err", err)
	}
	return nil
}

// end is the error a watch ends with after err: none when the client went
// away.
func (w *watcher) end(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return mapError(err)
}

// step delivers what the watch may: while events are held, nothing until
// none of the transactions running at their read may still write events
// (or MaxGrace passed); then it reads the events after the cursor, delivers
// those up to what the hold covered, or all of them when the read was final
// (no transaction running at it, or none that may write events and none
// that ended since), holds the rest, and says when to read again.
func (w *watcher) step(ctx context.Context, send func(store.Event) error) (readNext, error) {
	db, clk := w.s.db, w.s.clock
	// Decide before reading whether the hold has passed, so that an event
	// whose transaction committed before the check is read.
	var covered int64 // the events up to it may be delivered
	if h := w.hold; h != nil {
		if held := clock.Since(clk, h.seen); held >= w.cfg.MaxGrace {
			w.s.logger.WarnContext(ctx, "watch: delivering events held past the grace for transactions still running",
				"after", w.cursor, "up_to", h.upTo, "held", held)
		} else {
			writing, _, err := store.EventWriters(ctx, db.Pool, h.running)
			if err != nil {
				return readOnWake, err
			}
			if writing {
				return readOnRecheck, nil
			}
		}
		covered = h.upTo
	}
	scan, err := store.ScanEvents(ctx, db.AutoCommit(), w.cursor, w.filter, w.cfg.Batch)
	if err != nil {
		return readOnWake, err
	}
	if scan.RemovedThrough > w.cursor && !w.fromStart {
		// Retention removed events after the cursor while the watch ran
		// (it was that far behind): it cannot go on without a gap.
		_, oldest, err := store.EventRetention(ctx, db.Pool, w.filter.Scope)
		if err != nil {
			return readOnWake, err
		}
		return readOnWake, w.removedError(w.cursor, oldest)
	}
	w.hold = nil
	if len(scan.Events) == 0 {
		return readOnWake, nil
	}
	upTo := scan.Events[len(scan.Events)-1].ID
	var (
		writing, ended bool
		held           []int64
	)
	if upTo > covered {
		if writing, ended, held, err = store.ScanWriters(ctx, db.Pool, scan); err != nil {
			return readOnWake, err
		}
		if !writing && !ended {
			covered = upTo // the read was final
		}
	}
	for _, e := range scan.Events {
		if e.ID > covered {
			w.hold = &gapHold{seen: clk.Now(), running: held, upTo: upTo, recheck: w.cfg.GapRecheck}
			if !writing {
				return readNow, nil // only ended ones: a read from now on is final
			}
			return readOnRecheck, nil
		}
		if err := send(e); err != nil {
			return readOnWake, err
		}
		w.cursor, w.fromStart = e.ID, false
	}
	if len(scan.Events) == w.cfg.Batch {
		return readNow, nil
	}
	return readOnWake, nil
}
