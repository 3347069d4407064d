package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"buf.build/go/protovalidate"
	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
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
// that never fills. A watcher delivers strictly by id and never steps over a
// missing id that may still commit. When it meets a gap (ids missing below a
// committed one) it holds the events after it and records the database's
// transaction horizon (store.CurrentTxHorizon Xmax): the transaction that
// took a missing id took it before the committed id after it, so it was
// running (or had ended) when the gap was seen. The gap is stepped over once
// every transaction running then has ended (a later Xmin ≥ that Xmax, and
// the missing id is still missing when read after that check), but not
// before MinGrace (an insert is assigned its transaction id just after its
// sequence value; MinGrace covers that instant), and at the latest after
// MaxGrace, so that an unrelated long transaction cannot stall every watch
// (an event whose transaction outlives MaxGrace is then not delivered to
// watches that were live; a watch resumed later does get it).
//
// An old gap is not held for MinGrace: when the committed rows after it
// were inserted at least MinGrace before the watch read them, by the
// database's own clock (events.inserted_at, store.ScannedEvent.Old; not
// created_at, which is the writer's clock read before the insert), every
// id missing below them was taken at least that long before, so its
// transaction had its transaction id when the horizon was recorded, and the
// horizon check alone decides. A watch replaying history checks an old gap
// again at once; a gap the check does not yet pass is checked again after
// GapRecheck, doubling up to Poll (a new gap: first at MinGrace), as well as
// at every wake and poll.
type WatchConfig struct {
	// Poll is how often a watch reads the events table when NATS wakes it
	// for nothing (the backstop; default 1 s).
	Poll time.Duration
	// MinGrace is the least time a new gap is held (default 1 s); also the
	// age past which a gap is old.
	MinGrace time.Duration
	// MaxGrace is the most time a gap is held (default 1 min).
	MaxGrace time.Duration
	// GapRecheck is how soon a watch holding a gap (past MinGrace, or old)
	// reads again, doubling at every read that does not step over it, up to
	// Poll (default 50 ms, at most Poll).
	GapRecheck time.Duration
	// Batch is how many events rows one read returns, which bounds a
	// watch's memory (default 500).
	Batch int
	// AuthCheck is how often an open watch authenticates its caller's
	// token again (default 1 s, the token cache's TTL, so that a check
	// costs a query at most once per TTL): a watch whose token was revoked
	// ends within about AuthCheck. A watch also ends at its token's expiry.
	AuthCheck time.Duration
}

func (c WatchConfig) withDefaults() WatchConfig {
	if c.Poll <= 0 {
		c.Poll = time.Second
	}
	if c.MinGrace <= 0 {
		c.MinGrace = time.Second
	}
	if c.MaxGrace <= 0 {
		c.MaxGrace = time.Minute
	}
	if c.MaxGrace < c.MinGrace {
		c.MaxGrace = c.MinGrace
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
	return c
}

type eventService struct{ *Server }

// Watch streams the events of the caller's tenant (every tenant's for
// root-admin) whose type matches req.Types, after req.AfterId (0: from the
// newest committed event; with req.FromStart: every retained event), oldest
// first, then each new one as it commits
// (WatchConfig says how gaps in the ids are handled). It refuses
// (InvalidArgument) a type pattern that matches none of store.EventTypes
// ("types[i]: …") and an after_id above the newest committed event id
// ("after_id: …", naming that id). It ends when the
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

// watchEventJSON is one line of WatchPath, the shape of the events NATS
// carries (pkg/store WriteEvents).
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
// token), 403 (role without events.read), 400 (bad query parameter, named),
// 503 (database unreachable: retry) or 500. Once the response has begun
// (200), an error ends it with one last line of that shape, which has no
// "id": {"code": "unavailable", …} when the server shuts down or the
// database cannot be reached (resume with the last id), {"code":
// "unauthenticated", "message": "api token was revoked"} (or "… expired
// at …") when the token no longer authenticates (checked every
// WatchConfig.AuthCheck and at its expiry), {"code": "internal", "message":
// "internal error"} otherwise.
func (s *Server) serveWatch(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	authorization := r.Header.Get("Authorization")
	p, err := s.authn.Authenticate(ctx, authorization)
	switch {
	case errors.Is(err, iam.ErrUnauthenticated):
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, err.Error())
		return
	case err != nil:
		s.writeStreamError(w, r, "watch", false, fmt.Errorf("authenticate: %w", err))
		return
	case !p.Can(iam.PermEventsRead):
		writeHTTPError(w, http.StatusForbidden, connect.CodePermissionDenied,
			"role "+string(p.Role)+" may not watch events (needs "+string(iam.PermEventsRead)+")")
		return
	}
	q := r.URL.Query()
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
			writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument, name+": given more than once")
			return
		}
	}
	if a := q.Get("after"); a != "" {
		if req.AfterId, err = strconv.ParseInt(a, 10, 64); err != nil || req.AfterId < 0 {
			writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument, "after: want an event id (an integer ≥ 0)")
			return
		}
	}
	if q.Has("from_start") {
		if req.FromStart, err = strconv.ParseBool(q.Get("from_start")); err != nil {
			writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument, "from_start: want true or false")
			return
		}
		if req.FromStart && req.AfterId != 0 {
			writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument,
				"from_start: cannot be combined with after="+strconv.FormatInt(req.AfterId, 10))
			return
		}
	}
	if err := protovalidate.Validate(req); err != nil {
		writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument, err.Error())
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
		case connect.CodeUnavailable:
			status = http.StatusServiceUnavailable
		case connect.CodeUnauthenticated:
			status = http.StatusUnauthorized
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
// the id the watch starts after: the request's after_id, the newest event
// id when it asked for events "from now" (after_id 0), or 0 with
// from_start. A client that loses the stream before any event resumes
// after it, so that nothing committed meanwhile is missed; after 0 it
// resumes with from_start (a watch from now that says 0 began when there
// was no event: every event retained since is new to it), as after_id 0
// would mean "from now" again.
const WatchCursorHeader = "Bc-Watch-After"

// gapHold is a watch's wait for missing ids to commit (WatchConfig).
type gapHold struct {
	// seen is when the gap was first met.
	seen time.Time
	// xmax is the transaction horizon's Xmax then.
	xmax int64
	// upTo is the highest committed id read then (of an old gap: the
	// highest old one): it covers every id missing below it.
	upTo int64
	// old is whether the row upTo was inserted at least MinGrace before it
	// was read (store.ScannedEvent.Old): the hold needs no MinGrace.
	old bool
	// recheck is the wait before the next read (GapRecheck, doubling).
	recheck time.Duration
}

// readNext is when a watch reads the events table again, as step decides.
type readNext int

const (
	// readOnWake: caught up; read at the next wake (NATS) or poll.
	readOnWake readNext = iota
	// readNow: read again at once: the read was full, or it met an old
	// gap that the horizon may let it step over already.
	readNow
	// readOnRecheck: a gap is held; read again after recheckDelay, or at a
	// wake or poll if one comes first.
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
	// cursor is the last id delivered or stepped over.
	cursor int64
	hold   *gapHold
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
// fixes the cursor (req.after; 0 with req.fromStart, so that every retained
// event comes; otherwise the newest committed id when req.after is 0),
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
		filter: store.EventFilter{Scope: p.Scope(), Types: req.types}, cursor: req.after}
	if req.after != 0 {
		newest, err := store.MaxEventID(ctx, s.db.Pool)
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
		// The outbox relay publishes an event after its commit: a hint to
		// read now rather than at the next poll.
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
		id, err := store.MaxEventID(ctx, s.db.Pool)
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
		if next == readOnRecheck {
			recheckTimer.Reset(w.recheckDelay())
			recheck = recheckTimer.C()
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

// recheckDelay is how long a watch holding a gap waits before it reads
// again (WatchConfig): a new gap until MinGrace after it was met, then
// hold.recheck, which doubles up to Poll; never past MaxGrace.
func (w *watcher) recheckDelay() time.Duration {
	h := w.hold
	held := clock.Since(w.s.clock, h.seen)
	if !h.old && held < w.cfg.MinGrace {
		return w.cfg.MinGrace - held
	}
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

// step reads the events after the cursor once and delivers them up to the
// first gap it may not step over, and says when to read again.
func (w *watcher) step(ctx context.Context, send func(store.Event) error) (readNext, error) {
	db, clk := w.s.db, w.s.clock
	// Decide before reading whether the held gap may be stepped over, so
	// that an id whose transaction committed before the check is read.
	var covered int64 // missing ids below it may be stepped over
	if h := w.hold; h != nil {
		switch held := clock.Since(clk, h.seen); {
		case held >= w.cfg.MaxGrace:
			covered = h.upTo
			w.s.logger.WarnContext(ctx, "watch: stepping over event ids still missing after the grace", "after", w.cursor,
				"up_to", h.upTo, "held", held)
		case h.old || held >= w.cfg.MinGrace:
			hz, err := store.CurrentTxHorizon(ctx, db.Pool)
			if err != nil {
				return readOnWake, err
			}
			if hz.Xmin >= h.xmax {
				covered = h.upTo
			}
		}
	}
	rows, err := store.ScanEvents(ctx, db.AutoCommit(), w.cursor, w.filter, w.cfg.Batch, w.cfg.MinGrace)
	if err != nil {
		return readOnWake, err
	}
	for i, r := range rows {
		if r.ID != w.cursor+1 && r.ID > covered {
			// Missing ids before r: hold r and what follows.
			if w.hold != nil && r.ID <= w.hold.upTo {
				return readOnRecheck, nil
			}
			hz, err := store.CurrentTxHorizon(ctx, db.Pool)
			if err != nil {
				return readOnWake, err
			}
			w.hold = &gapHold{seen: clk.Now(), xmax: hz.Xmax, upTo: rows[len(rows)-1].ID, recheck: w.cfg.GapRecheck}
			if !r.Old {
				return readOnRecheck, nil
			}
			// Every id missing below an old row was taken MinGrace or more
			// ago. The hold covers the ids up to the highest old row read;
			// a gap above it is new, met again once this one is passed.
			w.hold.old = true
			for _, o := range rows[i:] {
				if o.Old {
					w.hold.upTo = o.ID
				}
			}
			return readNow, nil
		}
		if r.Match {
			if err := send(r.Event); err != nil {
				return readOnWake, err
			}
		}
		w.cursor = r.ID
		if w.hold != nil && w.cursor >= w.hold.upTo {
			w.hold = nil
		}
	}
	switch {
	case len(rows) == w.cfg.Batch:
		return readNow, nil
	case w.hold != nil:
		return readOnRecheck, nil
	}
	return readOnWake, nil
}
