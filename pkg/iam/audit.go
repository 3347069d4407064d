package iam

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/better-compute/better-compute/pkg/store"
)

// OutcomeOK is the outcome of an audited call that succeeded; a refused
// call's outcome is its Connect code in snake_case (connect.Code.String:
// "permission_denied", "not_found", …).
const OutcomeOK = "ok"

// Lengths past which an audit row's target and detail are cut (bytes): a
// refused request's fields are the caller's and may be long.
const (
	maxAuditTarget = 128
	maxAuditDetail = 1024
)

// auditWriteTimeout bounds writing the audit row of a call whose context
// has ended.
const auditWriteTimeout = 5 * time.Second

// auditRecord is the audit row of one mutating call in progress, carried in
// its context from NewAuditInterceptor through the authorization
// interceptor (who) to the handler (AuditInTx).
type auditRecord struct {
	procedure string
	target    string // from the request's Rule.Target field

	mu        sync.Mutex
	principal Principal
	written   bool // the handler wrote the success row in its transaction
}

type auditKey struct{}

func auditFrom(ctx context.Context) *auditRecord {
	rec, _ := ctx.Value(auditKey{}).(*auditRecord)
	return rec
}

func (r *auditRecord) setPrincipal(p Principal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.principal = p
}

// entry returns the row of the call with outcome and detail at time at;
// target overrides the request's when not empty. The row of a caller that
// was not authenticated keeps no target from the request: it names nothing
// the caller proved it may touch.
func (r *auditRecord) entry(at time.Time, target, outcome, detail string) store.AuditEntry {
	r.mu.Lock()
	p := r.principal
	r.mu.Unlock()
	if target == "" && p.TokenID != "" {
		target = r.target
	}
	return store.AuditEntry{At: at, TenantID: p.TenantID, TokenID: p.TokenID, Role: string(p.Role),
		Procedure: r.procedure, Target: truncate(target, maxAuditTarget), Outcome: outcome,
		Detail: truncate(detail, maxAuditDetail)}
}

// AuditInTx writes the success row of the mutating call in ctx, in q (the
// transaction of the call's change, so that both commit or neither):
// target is the id of the resource acted on (the new one, for a create),
// detail says what changed. Call it at the end of the transaction's
// function, on every path that commits; when the function fails, the
// transaction rolls back and the audit interceptor writes the refusal
// instead. Errors: the procedure is not marked Mutating in the policy (no
// audit record in ctx), or the database's.
func AuditInTx(ctx context.Context, q store.DBTX, at time.Time, target, detail string) error {
	d, err := DeferAudit(ctx)
	if err != nil {
		return err
	}
	if _, err := store.InsertAudit(ctx, q, d.Entry(at, target, detail)); err != nil {
		return err
	}
	d.Written()
	return nil
}

// DeferredAudit is the success row of a mutating call that a batch writes
// on the call's behalf, in the batch's transaction (the command queue
// batches RunCommand calls): DeferAudit takes it from the call's context,
// Entry gives the row to insert (store.InsertAudits), and Written, called
// once the batch committed, keeps the audit interceptor from writing
// another.
type DeferredAudit struct{ rec *auditRecord }

// DeferAudit returns the DeferredAudit of the mutating call in ctx. Errors:
// the procedure is not marked Mutating in the policy (as AuditInTx).
func DeferAudit(ctx context.Context) (DeferredAudit, error) {
	rec := auditFrom(ctx)
	if rec == nil {
		return DeferredAudit{}, errors.New("audit: no audit record in the context (is the RPC marked Mutating in the policy?)")
	}
	return DeferredAudit{rec: rec}, nil
}

// Entry is the success row at time at, as AuditInTx writes it.
func (d DeferredAudit) Entry(at time.Time, target, detail string) store.AuditEntry {
	return d.rec.entry(at, target, OutcomeOK, detail)
}

// Written records that the row committed.
func (d DeferredAudit) Written() {
	d.rec.mu.Lock()
	d.rec.written = true
	d.rec.mu.Unlock()
}

// NewAuditInterceptor returns a Connect handler interceptor that writes one
// audit row per call of every procedure the policy marks Mutating by an
// authenticated caller: the success row when the handler did not write it
// itself with AuditInTx (outcome "ok", target from the request's
// Rule.Target field), and for a refusal the Connect code as outcome and the
// error message as detail. A call refused before its caller authenticated
// (no token, a bad one, a throttled source) writes no row; the
// bc.auth.failures metric counts it (Authenticator.AuthenticateFrom).
//
// Install it outside (before) the validation and authorization
// interceptors, so that it sees every refusal of an authenticated caller
// (permission denied, invalid argument, not found, …); the authorization
// interceptor fills in the caller. Refusals are written after the call with the
// database's clock; a failure to write is logged, and the call's own result
// is returned unchanged.
func NewAuditInterceptor(db *store.DB, policy Policy, logger *slog.Logger) connect.Interceptor {
	return &auditInterceptor{db: db, policy: policy, logger: logger}
}

type auditInterceptor struct {
	db     *store.DB
	policy Policy
	logger *slog.Logger
}

// begin returns ctx with a new audit record when procedure is mutating.
func (a *auditInterceptor) begin(ctx context.Context, procedure string, msg any) (context.Context, *auditRecord) {
	rule, ok := a.policy[procedure]
	if !ok || !rule.Mutating {
		return ctx, nil
	}
	rec := &auditRecord{procedure: procedure}
	if m, ok := msg.(proto.Message); ok && rule.Target != "" {
		rec.target = stringField(m, rule.Target)
	}
	return context.WithValue(ctx, auditKey{}, rec), rec
}

// finish writes the row the handler did not. A call whose caller never
// authenticated writes none: it names nobody, and a flood of such calls
// must not become a flood of writes (bc.auth.failures counts them).
func (a *auditInterceptor) finish(ctx context.Context, rec *auditRecord, err error) {
	rec.mu.Lock()
	written, anonymous := rec.written, rec.principal.TokenID == ""
	rec.mu.Unlock()
	var e store.AuditEntry
	switch {
	case err == nil && written, err != nil && anonymous:
		return
	case err == nil:
		e = rec.entry(a.db.Now(), "", OutcomeOK, "")
	default:
		detail := err.Error()
		var cerr *connect.Error
		if errors.As(err, &cerr) {
			detail = cerr.Message()
		}
		e = rec.entry(a.db.Now(), "", connect.CodeOf(err).String(), detail)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), auditWriteTimeout)
	defer cancel()
	if _, werr := store.InsertAudit(ctx, a.db.Pool, e); werr != nil {
		a.logger.ErrorContext(ctx, "write audit row", "procedure", e.Procedure, "outcome", e.Outcome, "err", werr)
	}
}

func (a *auditInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		ctx, rec := a.begin(ctx, req.Spec().Procedure, req.Any())
		if rec == nil {
			return next(ctx, req)
		}
		res, err := next(ctx, req)
		a.finish(ctx, rec, err)
		return res, err
	}
}

func (a *auditInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

// WrapStreamingHandler audits a mutating stream as one call, without a
// target from the request (its messages come later).
func (a *auditInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, rec := a.begin(ctx, conn.Spec().Procedure, nil)
		if rec == nil {
			return next(ctx, conn)
		}
		err := next(ctx, conn)
		a.finish(ctx, rec, err)
		return err
	}
}

// stringField returns m's string field named name (proto name), or "" when
// m has none.
func stringField(m proto.Message, name string) string {
	r := m.ProtoReflect()
	fd := r.Descriptor().Fields().ByName(protoreflect.Name(name))
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() || fd.IsMap() {
		return ""
	}
	return r.Get(fd).String()
}

// truncate makes s storable as Postgres text (valid UTF-8 without NUL) and
// cuts it to at most n bytes on a rune boundary, marking the cut.
func truncate(s string, n int) string {
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
	if len(s) <= n {
		return s
	}
	cut := n - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
