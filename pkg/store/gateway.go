package store

// Queries of the gateway: node sessions (open, close, supersession), the
// certificates a session presents, delivery of commands and desired state,
// command updates from daemons, reported generations and batched last_seen.
//
// Session ownership: nodes.session_id names the one live session of a node.
// Every write a session makes on behalf of its node that could conflict with a
// newer session (claiming commands, clearing the session) is conditioned on
// session_id still being its own.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Command states of the commands table, as the gateway uses them.
const (
	cmdQueued    = "queued"
	cmdDelivered = "delivered"
	cmdRunning   = "running"
	cmdSucceeded = "succeeded"
	cmdFailed    = "failed"
	cmdExpired   = "expired"
	cmdCanceled  = "canceled"
)

// cmdRank orders command states: a command only moves to a higher rank.
// Terminal states share the highest rank so that none replaces another.
var cmdRank = map[string]int{
	cmdQueued:    0,
	cmdDelivered: 1,
	cmdRunning:   2,
	cmdSucceeded: 3,
	cmdFailed:    3,
	cmdExpired:   3,
	cmdCanceled:  3,
}

// SessionCert is what a session needs of a row of node_certs.
type SessionCert struct {
	Serial   string
	NodeID   string
	NotAfter time.Time
	// RevokedAt is when the certificate, or its whole node (nodes.revoked_at),
	// was revoked; nil when neither is.
	RevokedAt *time.Time
}

const sessionCertQuery = `SELECT c.serial, c.node_id, c.not_after, COALESCE(c.revoked_at, n.revoked_at)
	FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = $1`

// GetSessionCert returns the node certificate with serial (lower-case hex, see
// pki.SerialHex), or ErrNotFound.
func GetSessionCert(ctx context.Context, q DBTX, serial string) (SessionCert, error) {
	return scanSessionCert(q.QueryRow(ctx, sessionCertQuery, serial))
}

// LockSessionCert is GetSessionCert that also locks the certificate's node
// (FOR SHARE) until the transaction ends, so that a concurrent RevokeNode
// either commits first (and RevokedAt shows it) or waits: a certificate
// issued in the same transaction never outlives a revocation.
func LockSessionCert(ctx context.Context, q DBTX, serial string) (SessionCert, error) {
	return scanSessionCert(q.QueryRow(ctx, sessionCertQuery+` FOR SHARE OF n`, serial))
}

func scanSessionCert(row pgx.Row) (SessionCert, error) {
	var c SessionCert
	if err := row.Scan(&c.Serial, &c.NodeID, &c.NotAfter, &c.RevokedAt); err != nil {
		return SessionCert{}, interpretError(err)
	}
	return c, nil
}

// OpenSessionParams describe a session a node opened on a gateway.
type OpenSessionParams struct {
	NodeID    string
	GatewayID string
	SessionID string
	BootID    string
	// AgentVersion is stored when not empty.
	AgentVersion string
	// ObservedGeneration is what the daemon said it applied; the stored
	// value becomes the greater of the two.
	ObservedGeneration int64
	Now                time.Time
}

// OpenedSession is the node's state right after OpenSession.
type OpenedSession struct {
	// Epoch is the node's new session_epoch (one more than before).
	Epoch int64
	// SpecGeneration is the node's desired spec generation.
	SpecGeneration int64
}

// OpenSession makes p the node's live session: it records gateway_id,
// session_id, session_epoch+1, boot_id, last_seen and reachable. Any older
// session of the node, on any gateway, is superseded. A node that was
// unreachable gets a node.reachable event (once per transition: the row is
// locked). Call it in a transaction. It returns ErrNotFound when the node
// does not exist.
func OpenSession(ctx context.Context, q DBTX, p OpenSessionParams) (OpenedSession, error) {
	var (
		o        OpenedSession
		wasUp    bool
		owner    string
		lastSeen *time.Time
	)
	err := q.QueryRow(ctx, `WITH prev AS (SELECT id, reachable, last_seen FROM nodes WHERE id = $1 FOR UPDATE)
		UPDATE nodes n SET
			gateway_id = $2, session_id = $3, session_epoch = n.session_epoch + 1,
			boot_id = $4, agent_version = CASE WHEN $5 = '' THEN n.agent_version ELSE $5 END,
			observed_generation = GREATEST(n.observed_generation, $6),
			last_seen = $7, reachable = true, updated_at = $7
		FROM prev, pools p WHERE n.id = prev.id AND p.id = n.pool_id
		RETURNING n.session_epoch, n.spec_generation, prev.reachable, prev.last_seen, p.owner_tenant_id`,
		p.NodeID, p.GatewayID, p.SessionID, p.BootID, p.AgentVersion, p.ObservedGeneration, p.Now,
	).Scan(&o.Epoch, &o.SpecGeneration, &wasUp, &lastSeen, &owner)
	if err != nil {
		return OpenedSession{}, interpretError(err)
	}
	if !wasUp {
		data := map[string]any{"gatewayId": p.GatewayID, "sessionId": p.SessionID}
		if lastSeen != nil {
			data["previousLastSeen"] = lastSeen.UTC()
		}
		if err := InsertNodeEvents(ctx, q, p.Now, []NodeEvent{{TenantID: owner, Type: EventNodeReachable,
			NodeID: p.NodeID, Data: data}}); err != nil {
			return OpenedSession{}, err
		}
	}
	return o, nil
}

// CloseSession clears the node's gateway_id and session_id if sessionID is
// still its live session (a newer session is left alone), and raises
// last_seen to lastSeen (unless zero) either way. It reports whether it
// cleared the session. reachable is left to the liveness sweeper.
func CloseSession(ctx context.Context, q DBTX, now time.Time, nodeID, sessionID string, lastSeen time.Time) (bool, error) {
	var ls *time.Time
	if !lastSeen.IsZero() {
		ls = &lastSeen
	}
	tag, err := q.Exec(ctx, `UPDATE nodes SET gateway_id = NULL, session_id = NULL,
			last_seen = GREATEST(last_seen, $3), updated_at = $4
		WHERE id = $1 AND session_id = $2`, nodeID, sessionID, ls, now)
	if err != nil {
		return false, interpretError(err)
	}
	if tag.RowsAffected() > 0 {
		return true, nil
	}
	if ls != nil {
		if _, err := q.Exec(ctx, `UPDATE nodes SET last_seen = GREATEST(last_seen, $2) WHERE id = $1`, nodeID, ls); err != nil {
			return false, interpretError(err)
		}
	}
	return false, nil
}

// SessionCommand is a command handed to a session for delivery.
type SessionCommand struct {
	ID        string
	Kind      string
	Args      []byte
	Deadline  time.Time
	RetrySafe bool
	CreatedAt time.Time
	// Signature is the command-signing root's signature (signedIntent), nil
	// when the command is unsigned. See CommandMessage.
	Signature []byte
}

// SessionDelivery is the work ClaimSessionDelivery found for a session.
type SessionDelivery struct {
	// Current is false when the session is no longer the node's live
	// session; nothing was claimed then.
	Current bool
	// Revoked is true when the node is revoked (nodes.revoked_at); nothing
	// was claimed then, and the session must end.
	Revoked bool
	// SpecGeneration is the node's desired spec generation.
	SpecGeneration int64
	// Spec is the node's spec (protojson of gatewayv1.NodeSpec), set only
	// when SpecGeneration is greater than the caller's known generation.
	Spec []byte
	// SpecSignature is the signature of that spec generation (signedIntent),
	// nil when unsigned or when Spec is nil. See DesiredStateMessage.
	SpecSignature []byte
	// Commands are the claimed commands, oldest first.
	Commands []SessionCommand
}

// ClaimSessionDelivery finds the work of sessionID, the live session of nodeID: the
// spec when its generation is greater than known, and the open commands to
// send. It claims the queued ones, or with inFlight (a new session) also the
// delivered and running ones, by setting state delivered (running stays
// running), delivered_at and deliveries+1. Claiming is conditioned on the
// session still being live and the node not revoked in the same statement,
// so a superseded session never takes a newer session's commands and a
// revoked node gets nothing. One round trip.
func ClaimSessionDelivery(ctx context.Context, q DBTX, now time.Time, nodeID, sessionID string, known int64, inFlight bool) (SessionDelivery, error) {
	states := []string{cmdQueued}
	if inFlight {
		states = append(states, cmdDelivered, cmdRunning)
	}
	b := &pgx.Batch{}
	b.Queue(`SELECT session_id IS NOT DISTINCT FROM $2, revoked_at IS NOT NULL, spec_generation,
			CASE WHEN spec_generation > $3 THEN spec END, CASE WHEN spec_generation > $3 THEN spec_signature END
		FROM nodes WHERE id = $1`, nodeID, sessionID, known)
	b.Queue(`UPDATE commands SET
			state = CASE WHEN state = 'queued' THEN 'delivered' ELSE state END,
			delivered_at = $4, deliveries = deliveries + 1, updated_at = $4
		WHERE node_id = $1 AND state = ANY($3)
			AND EXISTS (SELECT 1 FROM nodes WHERE id = $1 AND session_id = $2 AND revoked_at IS NULL)
		RETURNING id, kind, args, deadline, retry_safe, created_at, signature`, nodeID, sessionID, states, now)
	br := q.SendBatch(ctx, b)
	defer br.Close()
	var d SessionDelivery
	if err := br.QueryRow().Scan(&d.Current, &d.Revoked, &d.SpecGeneration, &d.Spec, &d.SpecSignature); err != nil {
		return SessionDelivery{}, interpretError(err)
	}
	rows, err := br.Query()
	if err != nil {
		return SessionDelivery{}, interpretError(err)
	}
	for rows.Next() {
		var c SessionCommand
		if err := rows.Scan(&c.ID, &c.Kind, &c.Args, &c.Deadline, &c.RetrySafe, &c.CreatedAt, &c.Signature); err != nil {
			rows.Close()
			return SessionDelivery{}, err
		}
		d.Commands = append(d.Commands, c)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return SessionDelivery{}, interpretError(err)
	}
	if err := br.Close(); err != nil {
		return SessionDelivery{}, interpretError(err)
	}
	slices.SortFunc(d.Commands, func(a, b SessionCommand) int {
		if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
			return c
		}
		return strings.Compare(a.ID, b.ID)
	})
	if !d.Current || d.Revoked {
		d.Spec, d.SpecSignature = nil, nil
	}
	return d, nil
}

// SessionCommandUpdate is a daemon's report on one of its node's commands.
type SessionCommandUpdate struct {
	NodeID    string
	CommandID string
	// State is delivered, running, succeeded or failed.
	State string
	// Result is stored when not nil (JSON).
	Result []byte
	// Error is stored when not empty.
	Error string
	Now   time.Time
}

// SessionCommandUpdated says what ApplySessionCommandUpdate did.
type SessionCommandUpdated struct {
	// Applied is false when the command does not exist, belongs to another
	// node, or is already in this state or a later one.
	Applied bool
	// Acceptance is true for the acceptance check of a joining node
	// (purpose 'acceptance'), whose terminal update wakes the controllers.
	Acceptance bool
	// Terminal is true when the command reached a terminal state.
	Terminal bool
}

// ApplySessionCommandUpdate moves a command of u.NodeID forward to u.State, never
// backward and never out of a terminal state, storing result and error and,
// for a terminal state, finished_at; a user command reaching succeeded or
// failed gets its command.succeeded or command.failed event in q's
// transaction. It fails for a state a daemon may not report (queued,
// expired, canceled or unknown).
func ApplySessionCommandUpdate(ctx context.Context, q DBTX, u SessionCommandUpdate) (SessionCommandUpdated, error) {
	switch u.State {
	case cmdDelivered, cmdRunning, cmdSucceeded, cmdFailed:
	default:
		return SessionCommandUpdated{}, fmt.Errorf("a daemon cannot move a command to %q", u.State)
	}
	var from []string
	for s, r := range cmdRank {
		if r < cmdRank[u.State] {
			from = append(from, s)
		}
	}
	terminal := cmdRank[u.State] == 3
	var out SessionCommandUpdated
	// What the terminal event needs comes back with the update.
	c := Command{ID: u.CommandID, NodeID: u.NodeID, State: u.State}
	err := q.QueryRow(ctx, `UPDATE commands c SET
			state = $3,
			result = COALESCE($4::jsonb, c.result),
			error = CASE WHEN $5 = '' THEN c.error ELSE $5 END,
			finished_at = CASE WHEN $6 THEN $7 ELSE c.finished_at END,
			delivered_at = COALESCE(c.delivered_at, $7),
			updated_at = $7
		FROM nodes n JOIN pools p ON p.id = n.pool_id
		WHERE c.id = $1 AND c.node_id = $2 AND c.state = ANY($8) AND n.id = c.node_id
		RETURNING c.purpose = 'acceptance', p.owner_tenant_id, c.kind, c.error`,
		u.CommandID, u.NodeID, u.State, nullJSON(u.Result), u.Error, terminal, u.Now, from,
	).Scan(&out.Acceptance, &c.TenantID, &c.Kind, &c.Error)
	if err != nil {
		err = interpretError(err)
		if errors.Is(err, ErrNotFound) {
			return SessionCommandUpdated{}, nil
		}
		return SessionCommandUpdated{}, err
	}
	out.Applied = true
	out.Terminal = terminal
	if terminal && !out.Acceptance {
		if err := recordCommandFinished(ctx, q, u.Now, c); err != nil {
			return SessionCommandUpdated{}, err
		}
	}
	return out, nil
}

func nullJSON(b []byte) *string {
	if b == nil {
		return nil
	}
	s := string(b)
	return &s
}

// RecordSessionObservedGeneration raises the node's observed_generation to gen (it
// never lowers it) and reports whether it changed.
func RecordSessionObservedGeneration(ctx context.Context, q DBTX, now time.Time, nodeID string, gen int64) (bool, error) {
	tag, err := q.Exec(ctx, `UPDATE nodes SET observed_generation = $2, updated_at = $3
		WHERE id = $1 AND observed_generation < $2`, nodeID, gen, now)
	if err != nil {
		return false, interpretError(err)
	}
	return tag.RowsAffected() > 0, nil
}

// SessionLastSeen is what a gateway heard from a node since its last flush.
type SessionLastSeen struct {
	NodeID    string
	SessionID string
	// At is when the gateway last heard from the node.
	At time.Time
	// ObservedGeneration is the greatest generation the daemon reported
	// (0 when none).
	ObservedGeneration int64
}

// RecordSessionLastSeen writes a batch of SessionLastSeen: last_seen and
// observed_generation only ever rise; reachable becomes true where the
// session is still the node's live one, with a node.reachable event for
// each node that was unreachable (once per transition: rows are locked).
// Rows are locked in node id order, so concurrent batches do not deadlock
// each other. Call it in a transaction. It returns how many nodes it
// updated.
func RecordSessionLastSeen(ctx context.Context, q DBTX, batch []SessionLastSeen) (int64, error) {
	if len(batch) == 0 {
		return 0, nil
	}
	batch = slices.Clone(batch)
	slices.SortFunc(batch, func(a, b SessionLastSeen) int { return strings.Compare(a.NodeID, b.NodeID) })
	ids := make([]string, len(batch))
	sids := make([]string, len(batch))
	ats := make([]time.Time, len(batch))
	obs := make([]int64, len(batch))
	for i, s := range batch {
		ids[i], sids[i], ats[i], obs[i] = s.NodeID, s.SessionID, s.At, s.ObservedGeneration
	}
	rows, err := q.Query(ctx, `WITH u AS (
			SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bigint[]) AS t(id, sid, at, obs)),
		prev AS (SELECT n.id, n.reachable FROM nodes n WHERE n.id = ANY($1) ORDER BY n.id FOR UPDATE)
		UPDATE nodes n SET
			last_seen = GREATEST(n.last_seen, u.at),
			observed_generation = GREATEST(n.observed_generation, u.obs),
			reachable = n.reachable OR n.session_id IS NOT DISTINCT FROM u.sid
		FROM u, prev, pools p
		WHERE n.id = u.id AND prev.id = n.id AND p.id = n.pool_id
		RETURNING n.id, u.sid, u.at, NOT prev.reachable AND n.reachable, p.owner_tenant_id`, ids, sids, ats, obs)
	if err != nil {
		return 0, interpretError(err)
	}
	var (
		updated int64
		events  []NodeEvent
		at      time.Time
	)
	for rows.Next() {
		var (
			id, sid, owner string
			seen           time.Time
			flipped        bool
		)
		if err := rows.Scan(&id, &sid, &seen, &flipped, &owner); err != nil {
			rows.Close()
			return 0, err
		}
		updated++
		if seen.After(at) {
			at = seen
		}
		if flipped {
			events = append(events, NodeEvent{TenantID: owner, Type: EventNodeReachable, NodeID: id,
				Data: map[string]any{"sessionId": sid}})
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, interpretError(err)
	}
	if err := InsertNodeEvents(ctx, q, at, events); err != nil {
		return 0, err
	}
	return updated, nil
}

// SessionRef names a session a gateway holds.
type SessionRef struct {
	NodeID    string
	SessionID string
	// Serial is the session's client certificate serial (lower-case hex);
	// a revoked certificate makes the session Revoked. Empty checks only
	// the node.
	Serial string
}

// SessionWork is what PendingSessionWork found for one session.
type SessionWork struct {
	NodeID    string
	SessionID string
	// Superseded is true when the session is no longer the node's live
	// session (or the node is gone).
	Superseded bool
	// Revoked is true when the node or the session's certificate is revoked.
	Revoked bool
	// SpecGeneration is the node's desired spec generation.
	SpecGeneration int64
	// ObservedGeneration is the stored observed generation.
	ObservedGeneration int64
	// Queued is true when the node has queued commands.
	Queued bool
}

// PendingSessionWork checks all sessions of a gateway in one query and
// returns those that need attention: superseded sessions, sessions whose node
// or certificate is revoked, and sessions whose node has queued commands or a
// spec generation above its observed one.
func PendingSessionWork(ctx context.Context, q DBTX, sessions []SessionRef) ([]SessionWork, error) {
	if len(sessions) == 0 {
		return nil, nil
	}
	ids := make([]string, len(sessions))
	sids := make([]string, len(sessions))
	serials := make([]string, len(sessions))
	for i, s := range sessions {
		ids[i], sids[i], serials[i] = s.NodeID, s.SessionID, s.Serial
	}
	rows, err := q.Query(ctx, `SELECT u.id, u.sid,
			n.session_id IS DISTINCT FROM u.sid,
			n.revoked_at IS NOT NULL OR nc.revoked_at IS NOT NULL,
			COALESCE(n.spec_generation, 0), COALESCE(n.observed_generation, 0),
			EXISTS (SELECT 1 FROM commands c WHERE c.node_id = u.id AND c.state = 'queued')
		FROM unnest($1::text[], $2::text[], $3::text[]) AS u(id, sid, serial)
		LEFT JOIN nodes n ON n.id = u.id
		LEFT JOIN node_certs nc ON nc.serial = u.serial AND nc.node_id = u.id
		WHERE n.session_id IS DISTINCT FROM u.sid
			OR n.revoked_at IS NOT NULL OR nc.revoked_at IS NOT NULL
			OR n.spec_generation > n.observed_generation
			OR EXISTS (SELECT 1 FROM commands c WHERE c.node_id = u.id AND c.state = 'queued')`, ids, sids, serials)
	if err != nil {
		return nil, interpretError(err)
	}
	defer rows.Close()
	var out []SessionWork
	for rows.Next() {
		var w SessionWork
		if err := rows.Scan(&w.NodeID, &w.SessionID, &w.Superseded, &w.Revoked, &w.SpecGeneration, &w.ObservedGeneration, &w.Queued); err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, interpretError(rows.Err())
}
