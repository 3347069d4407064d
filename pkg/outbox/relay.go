// Package outbox publishes the outbox table to NATS: the relay takes (deletes)
// a batch of the rows that committed transactions wrote, publishes each to
// its subject, flushes, and only then commits, so a row costs one insert and
// one delete; a failed publish rolls the delete back and the rows wait for
// the next pass. A row that NATS can never take (a payload above the
// server's max payload, a subject NATS refuses) cannot stop the rows after
// it: the pass moves it to outbox_dead_letters with why
// (store.DeadLetterOutbox), counts it (bc.outbox.dead_letters), logs it as
// an error and goes on. Only those permanent failures set a row aside; a
// connection that is closed, draining or reconnecting fails the pass, which
// is retried. It wakes on store.SubjectOutboxWritten (published after
// commit by writers given store.DB.SignalOutboxVia) and on the commit-time
// NOTIFY of store.OutboxChannel (the others, or when publishing fails), and
// also polls, so a missed signal only delays. Several relays may
// run: rows are taken with FOR UPDATE SKIP LOCKED, and a message may be
// published more than once (a commit lost after the flush; pokes and events
// are idempotent hints to their readers). A row written with a trace
// context (store.OutboxMessage.Traceparent) is published inside a producer
// span of that trace, whose context the message carries in its
// traceparent header (docs/architecture.md, "Traces"). Every message names
// its row in store.OutboxIDHeader.
package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Relay moves outbox rows to NATS.
type Relay struct {
	DB     *store.DB
	NC     *nats.Conn
	Logger *slog.Logger
	Clock  clock.Clock
	// Poll is how often the relay looks without a notification; 1 s if zero.
	Poll time.Duration
	// Batch is how many rows one pass takes; 500 if zero.
	Batch int

	// Metrics makes the relay's instruments (bc.outbox.published,
	// publish_failures, dead_letters; docs/metrics.md); nil is the global
	// MeterProvider.
	Metrics *telemetry.Metrics

	// deadLetters counts the rows set aside, by cause; published the rows
	// published, by subject family; failures the passes rolled back (Run
	// makes them).
	deadLetters metric.Int64Counter
	published   metric.Int64Counter
	failures    metric.Int64Counter
}

// Subject families, the subject label of bc.outbox.published: the prefix
// of the subject up to its family's end (store's Subject* names).
var subjectFamilies = [...]struct {
	prefix, family string
}{
	{"bc.poke.gw.", "poke.gw"},
	{store.SubjectPokeControllers, "poke.controllers"},
	{store.SubjectPokeScheduler, "poke.scheduler"},
	{"bc.events.", "events"},
	{"bc.iam.", "iam"},
	{"", "other"},
}

// familyAttrs are the measurement options of subjectFamilies, made once.
var familyAttrs = func() (out [len(subjectFamilies)]metric.AddOption) {
	for i, f := range subjectFamilies {
		out[i] = telemetry.Attrs(attribute.String(telemetry.LabelSubject, f.family))
	}
	return out
}()

// family returns the index in subjectFamilies of subject's family.
func family(subject string) int {
	for i, f := range subjectFamilies {
		if strings.HasPrefix(subject, f.prefix) {
			return i
		}
	}
	return len(subjectFamilies) - 1
}

// Causes of a row set aside: the value of the cause attribute of
// bc.outbox.dead_letters.
const (
	// causeMaxPayload: the payload is larger than the NATS server's max
	// payload (nats.Conn.MaxPayload).
	causeMaxPayload = "max_payload"
	// causeBadSubject: the subject is not a NATS subject (empty, or with
	// white space).
	causeBadSubject = "bad_subject"
)

// straggleWindow is how far below the highest id it took a relay woken by a
// signal looks (store.TakeOutbox's after): ids are drawn when rows are
// inserted, so a transaction may commit rows below ids already taken, and
// those are in flight at most a few pool-fulls of batches (hundreds of ids)
// behind. A row further behind waits for the next poll, which reads from
// the oldest id.
const straggleWindow = 4096

// Name returns "outbox relay" (service.Runner).
func (r *Relay) Name() string { return "outbox relay" }

// Run relays until ctx ends.
func (r *Relay) Run(ctx context.Context) error {
	if r.Poll == 0 {
		r.Poll = time.Second
	}
	if r.Batch == 0 {
		r.Batch = 500
	}
	meter := r.Metrics.Meter("github.com/better-compute/better-compute/pkg/outbox")
	r.deadLetters = telemetry.Int64Counter(meter, telemetry.OutboxDeadLetters)
	r.published = telemetry.Int64Counter(meter, telemetry.OutboxPublished)
	r.failures = telemetry.Int64Counter(meter, telemetry.OutboxPublishFailures)
	wake := make(chan struct{}, 1)
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	sub, err := r.NC.Subscribe(store.SubjectOutboxWritten, func(*nats.Msg) { signal() })
	if err != nil {
		r.Logger.Warn("outbox relay: subscribe to the write signal; NOTIFY and polling only", "err", err)
	} else {
		defer func() { _ = sub.Unsubscribe() }()
	}
	go r.listen(ctx, wake)
	tick := r.Clock.NewTicker(r.Poll)
	defer tick.Stop()
	var last int64 // the highest id taken
	full := true   // read from the oldest id: at start and on each poll
	for {
		for {
			after := int64(0)
			if !full {
				after = max(0, last-straggleWindow)
			}
			n, top, err := r.drainOnce(ctx, after)
			last = max(last, top)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				r.failures.Add(ctx, 1)
				r.Logger.Warn("outbox relay pass failed", "err", err)
				break
			}
			if n < r.Batch {
				break
			}
		}
		full = false
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-tick.C():
			full = true
		}
	}
}

// drainOnce takes one batch of the rows with ids above after, publishes
// each or sets it aside, and returns how many rows it took and the highest
// id among them. The rows are deleted in the transaction that publishes
// them, which commits only after NATS has flushed them; a row that can
// never be published (publish's cause) is moved to outbox_dead_letters in
// that transaction and the others go on. On any other error it rolls back
// and every row stays for the next pass. The rows set aside are logged and
// counted once the transaction has committed.
func (r *Relay) drainOnce(ctx context.Context, after int64) (n int, top int64, err error) {
	var dead []deadLetter
	var sent [len(subjectFamilies)]int64
	err = r.DB.InGenericTx(ctx, func(tx pgx.Tx) error {
		dead = dead[:0]
		sent = [len(subjectFamilies)]int64{}
		msgs, err := store.TakeOutbox(ctx, tx, after, r.Batch)
		if err != nil || len(msgs) == 0 {
			return err
		}
		for _, m := range msgs {
			cause, err := r.publish(m)
			if err == nil {
				sent[family(m.Subject)]++
				continue
			}
			if cause == "" {
				return err
			}
			if err := store.DeadLetterOutbox(ctx, tx, r.Clock.Now(), m, err.Error()); err != nil {
				return err
			}
			dead = append(dead, deadLetter{msg: m, cause: cause, err: err})
		}
		if err := r.NC.FlushTimeout(5 * time.Second); err != nil {
			return err
		}
		n, top = len(msgs), msgs[len(msgs)-1].ID
		return nil
	})
	if err != nil {
		return 0, 0, err
	}
	for i, n := range sent {
		if n > 0 {
			r.published.Add(ctx, n, familyAttrs[i])
		}
	}
	for _, d := range dead {
		r.deadLetters.Add(ctx, 1, metric.WithAttributes(attribute.String(telemetry.LabelCause, d.cause)))
		r.Logger.ErrorContext(ctx, "outbox row set aside", "outbox.id", d.msg.ID, "subject", d.msg.Subject,
			"payload_bytes", len(d.msg.Payload), "cause", d.cause, "err", d.err)
	}
	return n, top, nil
}

// deadLetter is a row drainOnce set aside, and why.
type deadLetter struct {
	msg   store.OutboxMessage
	cause string
	err   error
}

// publish publishes m. An error that publishing m can never get past comes
// with its cause (causeMaxPayload, causeBadSubject), and m is to be set
// aside; an error without a cause (the connection is closed, draining or
// over its reconnect buffer) may pass, and m is to be retried.
func (r *Relay) publish(m store.OutboxMessage) (cause string, err error) {
	// MaxPayload is 0 before the first connection (RetryOnFailedConnect):
	// then nothing is known yet, and the publish is buffered.
	if limit := r.NC.MaxPayload(); limit > 0 && int64(len(m.Payload)) > limit {
		return causeMaxPayload, fmt.Errorf("payload of %d bytes is above the NATS server's max payload of %d bytes",
			len(m.Payload), limit)
	}
	if m.Traceparent == "" {
		err = r.NC.PublishMsg(outboxMsg(m))
	} else {
		err = r.publishTraced(m)
	}
	switch {
	case err == nil:
		return "", nil
	case errors.Is(err, nats.ErrMaxPayload):
		return causeMaxPayload, fmt.Errorf("payload of %d bytes: %w", len(m.Payload), err)
	case errors.Is(err, nats.ErrBadSubject):
		return causeBadSubject, fmt.Errorf("subject %q: %w", m.Subject, err)
	}
	return "", err
}

// outboxMsg is the NATS message of outbox row m: its subject and payload,
// and its id in store.OutboxIDHeader.
func outboxMsg(m store.OutboxMessage) *nats.Msg {
	msg := &nats.Msg{Subject: m.Subject, Data: m.Payload, Header: nats.Header{}}
	msg.Header.Set(store.OutboxIDHeader, strconv.FormatInt(m.ID, 10))
	return msg
}

// tracer makes the relay's publish spans (the global provider's).
var tracer = otel.Tracer("github.com/better-compute/better-compute/pkg/outbox")

// publishTraced publishes m, a row with a trace context, in a producer
// span of that trace, with the span's context in the traceparent header.
func (r *Relay) publishTraced(m store.OutboxMessage) error {
	ctx := telemetry.ContextWithTraceparent(context.Background(), m.Traceparent)
	ctx, span := tracer.Start(ctx, "outbox publish "+subjectFamilies[family(m.Subject)].family,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.system", "nats"),
			attribute.String("messaging.destination.name", m.Subject)))
	defer span.End()
	msg := outboxMsg(m)
	msg.Header.Set(telemetry.TraceparentHeader, telemetry.Traceparent(ctx))
	err := r.NC.PublishMsg(msg)
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	return err
}

// listen holds a LISTEN connection and signals wake on every notification;
// it reconnects after errors until ctx ends.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.Logger.Warn("outbox listen failed", "err", err)
		_ = clock.Sleep(ctx, r.Clock, time.Second)
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := r.DB.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "LISTEN "+store.OutboxChannel); err != nil {
		return err
	}
	// Rows committed while nothing listened (before the first LISTEN, or
	// between a lost connection and this one) sent their NOTIFY to no one:
	// drain once now that notifications are heard.
	select {
	case wake <- struct{}{}:
	default:
	}
	defer func() {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "UNLISTEN *")
	}()
	for {
		_, err := conn.Conn().WaitForNotification(ctx)
		if err != nil {
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}
