package store

// Queries of the gateway's sessions: open, close, supersession, delivery of
// commands and desired state, reported generations, batched last_seen and the
// periodic check of pending work. Command updates are command_updates.go's,
// the certificates a session presents trust.go's.
//
// Session ownership: nodes.session_id names the one live session of a node.
// Every write a session makes on behalf of its node that could conflict with a
// newer session (claiming commands, clearing the session) is conditioned on
// session_id still being its own.

import (
	"context"
	"slices"
	"strings"
	"time"
)

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

// OpenedSession is the node's state right after its session opened
// (OpenSessions).
type OpenedSession struct {
	// Epoch is the node's new session_epoch (one more than before).
	Epoch int64
	// SpecGeneration is the node's desired spec generation.
	SpecGeneration int64
}

// OpenSessionRequest asks OpenSessions to open a session of a node that
// presented the client certificate Serial.
type OpenSessionRequest struct {
	OpenSessionParams
	// Serial is the serial of the session's client certificate (lower-case
	// hex, pki.SerialHex).
	Serial string
}

// OpenSessionResult is what OpenSessions did with one OpenSessionRequest.
type OpenSessionResult struct {
	// Cert is the client certificate's row as GetSessionCert reads it; its
	// Serial is "" when the serial names no certificate (CertFound false).
	Cert SessionCert
	// CertFound is false when the serial names no certificate.
	CertFound bool
	// Opened is true when the session was opened; Session is then the
	// node's state right after.
	Opened  bool
	Session OpenedSession
}

// openSessionsSQL checks each request's certificate, opens the session of
// each request whose certificate may open it, locking the nodes in id order
// (FOR NO KEY UPDATE, the lock of the update itself: no key changes) so that
// concurrent batches do not deadlock each other, and writes the
// node.reachable event of each node that was not reachable
// (eventWriterCTE). It answers one row per request: the certificate's row
// (NULLs when unknown), then the opened session's columns (NULLs when not
// opened), the count of events written and their hints.
//
// An event's data is built here as NodeReachableData encodes it (jsonb, so
// the order of keys is jsonb's either way): nodeId, sessionId, gatewayId
// unless empty, previousLastSeen unless the node was never heard, in Go's
// RFC 3339 with the fraction's trailing zeros cut (time.RFC3339Nano; a
// timestamptz holds microseconds). The events are at the latest Now of the
// requests that made their nodes reachable.
var openSessionsSQL = `WITH u AS (
		SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bigint[], $8::timestamptz[])
			WITH ORDINALITY AS u(id, serial, gw, sid, boot, agent, obs, at, ord)),
	cert AS (
		SELECT u.ord, c.serial, c.node_id, c.not_after, COALESCE(c.revoked_at, n.revoked_at) AS revoked_at,
			c.node_id = u.id AND c.revoked_at IS NULL AND n.revoked_at IS NULL AND c.not_after > u.at AS ok
		FROM u JOIN node_certs c ON c.serial = u.serial JOIN nodes n ON n.id = c.node_id),
	prev AS (
		SELECT n.id, n.reachable, n.last_seen FROM nodes n
		WHERE n.id = ANY($1) AND n.id IN (SELECT u.id FROM u JOIN cert ON cert.ord = u.ord AND cert.ok)
		ORDER BY n.id FOR NO KEY UPDATE),
	up AS (
		UPDATE nodes n SET
			gateway_id = u.gw, session_id = u.sid, session_epoch = n.session_epoch + 1,
			boot_id = u.boot, agent_version = CASE WHEN u.agent = '' THEN n.agent_version ELSE u.agent END,
			observed_generation = GREATEST(n.observed_generation, u.obs),
			last_seen = u.at, reachable = true, updated_at = u.at
		FROM u, cert, prev, pools p
		WHERE cert.ord = u.ord AND cert.ok AND n.id = u.id AND prev.id = n.id AND p.id = n.pool_id
		RETURNING u.ord, u.id, u.sid, u.gw, u.at, n.session_epoch, n.spec_generation, prev.reachable,
			prev.last_seen, p.owner_tenant_id),
	latest AS (
		SELECT at FROM up WHERE NOT reachable ORDER BY at DESC, ord LIMIT 1),
	src AS (
		SELECT up.ord, up.owner_tenant_id AS tenant, '` + EventNodeReachable + `' AS type, up.id AS subject,
			jsonb_build_object('nodeId', up.id, 'sessionId', up.sid)
				|| CASE WHEN up.gw = '' THEN '{}'::jsonb ELSE jsonb_build_object('gatewayId', up.gw) END
				|| CASE WHEN up.last_seen IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('previousLastSeen',
					rtrim(rtrim(to_char(up.last_seen AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'), '0'), '.') || 'Z') END
				AS data,
			latest.at
		FROM up, latest WHERE NOT up.reachable),
	` + eventWriterCTE("src") + `
	SELECT u.ord, cert.serial, cert.node_id, cert.not_after, cert.revoked_at,
		up.session_epoch, up.spec_generation, ` + eventCountSQL + `, ` + eventHintsSQL + `
	FROM u LEFT JOIN cert ON cert.ord = u.ord LEFT JOIN up ON up.ord = u.ord`

// OpenSessions opens the sessions of reqs, in one statement for all of
// them when they name distinct nodes, and returns one OpenSessionResult per
// request, in their order. Opening a session makes it the node's live
// session at the request's Now: gateway_id, session_id, session_epoch+1,
// boot_id, agent_version (when not empty), observed_generation (the greater
// of the stored and the Hello's), last_seen and reachable; any older
// session of the node, on any gateway, is superseded. A request's session
// opens only when its certificate (Serial) is known,
// is its node's (NodeID), is not revoked nor is its node, and has not
// expired at Now (not_after after Now); otherwise nothing of its node
// changes and the result says what the certificate is. Several requests
// of one node open in their order, each superseding the one before (one
// more statement for each repeat), so the last holds the greatest epoch.
// The nodes that were unreachable get their node.reachable events in the
// statement that opens them, at the latest Now of their requests (per
// statement). Each statement is whole on its own: with distinct nodes q may
// be DB.AutoCommit (one round trip, no transaction around it), which a
// deadlock or serialization failure leaves as it was, so the call can be
// made again; with repeats, call it in a transaction.
func OpenSessions(ctx context.Context, q DBTX, reqs []OpenSessionRequest) ([]OpenSessionResult, error) {
	out := make([]OpenSessionResult, len(reqs))
	var hints []string
	for round := range sessionRounds(reqs) {
		n := len(round)
		cols := struct {
			ids, serials, gws, sids, boots, agents []string
			obs                                    []int64
			ats                                    []time.Time
		}{make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n),
			make([]int64, n), make([]time.Time, n)}
		for i, j := range round {
			r := reqs[j]
			cols.ids[i], cols.serials[i], cols.gws[i], cols.sids[i] = r.NodeID, r.Serial, r.GatewayID, r.SessionID
			cols.boots[i], cols.agents[i], cols.obs[i], cols.ats[i] = r.BootID, r.AgentVersion, r.ObservedGeneration, r.Now
		}
		rows, err := q.Query(ctx, openSessionsSQL, cols.ids, cols.serials, cols.gws, cols.sids, cols.boots, cols.agents,
			cols.obs, cols.ats)
		if err != nil {
			return nil, interpretError(err)
		}
		for rows.Next() {
			var (
				ord              int64
				serial, certNode *string
				notAfter         *time.Time
				revokedAt        *time.Time
				epoch, spec      *int64
				evented          int64
				roundHints       []string
			)
			if err := rows.Scan(&ord, &serial, &certNode, &notAfter, &revokedAt, &epoch, &spec, &evented, &roundHints); err != nil {
				rows.Close()
				return nil, err
			}
			if evented > 0 && len(roundHints) > 0 && ord == 1 {
				hints = append(hints, roundHints...)
			}
			res := &out[round[ord-1]]
			if serial != nil {
				res.CertFound = true
				res.Cert = SessionCert{Serial: *serial, NodeID: *certNode, NotAfter: *notAfter, RevokedAt: revokedAt}
			}
			if epoch == nil {
				continue
			}
			res.Opened = true
			res.Session = OpenedSession{Epoch: *epoch, SpecGeneration: *spec}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, interpretError(err)
		}
	}
	hintEvents(q, hints)
	return out, nil
}

// sessionRounds yields the indexes of reqs in rounds that each name a node
// at most once: the first request of every node, then the second of those
// that have two, and so on, each round in the order of reqs.
func sessionRounds(reqs []OpenSessionRequest) func(yield func([]int) bool) {
	return func(yield func([]int) bool) {
		seen := make(map[string]int, len(reqs)) // requests of each node placed so far
		var rounds [][]int
		for i, r := range reqs {
			k := seen[r.NodeID]
			seen[r.NodeID] = k + 1
			if k == len(rounds) {
				rounds = append(rounds, nil)
			}
			rounds[k] = append(rounds[k], i)
		}
		for _, round := range rounds {
			if !yield(round) {
				return
			}
		}
	}
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
	// Traceparent is the W3C trace context of the RunCommand call that
	// queued the command, "" when none: the gateway starts the span of its
	// delivery from it.
	Traceparent string
}

// ClaimRequest asks ClaimSessionDeliveries for the work of one session.
type ClaimRequest struct {
	// NodeID is the session's node.
	NodeID string
	// SessionID is the session, which must be the node's live session
	// (nodes.session_id) for anything to be claimed.
	SessionID string
	// Known is the greatest spec generation the session's daemon has or
	// was sent: the spec is returned only when the node's is greater.
	Known int64
	// InFlight also claims the delivered and running commands (a new
	// session resends them), not only the queued ones.
	InFlight bool
}

// SessionDelivery is the work ClaimSessionDeliveries found for a session.
type SessionDelivery struct {
	// Current is false when the session is no longer the node's live
	// session, or the node does not exist; nothing was claimed then.
	Current bool
	// Revoked is true when the node is revoked (nodes.revoked_at); nothing
	// was claimed then, and the session must end.
	Revoked bool
	// SpecGeneration is the node's desired spec generation.
	SpecGeneration int64
	// Spec is the node's spec (protojson of gatewayv1.NodeSpec), set only
	// when SpecGeneration is greater than the request's Known generation
	// and the session is current and not revoked.
	Spec []byte
	// SpecSignature is the signature of that spec generation (signedIntent),
	// nil when unsigned or when Spec is nil. See DesiredStateMessage.
	SpecSignature []byte
	// Commands are the claimed commands, oldest first (created_at, then id).
	Commands []SessionCommand
}

// claimSessionDeliveriesSQL is ClaimSessionDeliveries' statement. Its CTEs:
// u the requests, nd their nodes as the session sees them (live: the
// session is the node's and the node is not revoked; the spec only when
// the session lacks its generation), pick the open commands to claim of the
// live ones, locked in id order, upd the claim. It returns one row per
// request whose node exists (command false: its ord and the node's
// columns) and one per claimed command (command true: its node and the
// command's columns), the other side's columns NULL.
//
// pick reads the open commands of the live nodes in one scan of
// commands_open_idx whose index condition is the array of those nodes (an
// InitPlan), not in a join with nd: the statement runs with a generic plan
// (DB.AutoCommit), made once per connection, maybe while the index was
// nearly empty, and a join then planned the index's inner side as a scan
// of the whole index filtered by node, as cheap as a lookup by node while
// the index was empty, which became a scan of every open command of the
// fleet per node once thousands were queued (1.2 million buffers read by
// one claim of 256 nodes). A restriction on node_id of commands alone has
// one index path, the one whose index condition it is.
const claimSessionDeliveriesSQL = `WITH u AS (
		SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bool[]) WITH ORDINALITY AS u(id, sid, known, inflight, ord)),
	nd AS (
		SELECT u.ord, u.id, u.inflight, n.session_id IS NOT DISTINCT FROM u.sid AS current,
			n.revoked_at IS NOT NULL AS revoked, n.spec_generation,
			CASE WHEN n.spec_generation > u.known AND n.session_id = u.sid AND n.revoked_at IS NULL THEN n.spec END AS spec,
			CASE WHEN n.spec_generation > u.known AND n.session_id = u.sid AND n.revoked_at IS NULL
				THEN n.spec_signature END AS spec_signature,
			n.session_id = u.sid AND n.revoked_at IS NULL AS live
		FROM u JOIN nodes n ON n.id = u.id WHERE n.id = ANY($1)),
	pick AS (SELECT c.id FROM commands c
		-- finished_at IS NULL (open: see commands_finished_iff_terminal)
		-- matches commands_open_idx's predicate, so that the nodes' open
		-- commands are read by node_id from it.
		WHERE c.node_id = ANY (ARRAY(SELECT nd.id FROM nd WHERE nd.live)) AND c.finished_at IS NULL
			AND (c.state = 'queued' OR c.node_id = ANY (ARRAY(SELECT nd.id FROM nd WHERE nd.live AND nd.inflight)))
		ORDER BY c.id FOR UPDATE OF c),
	upd AS (
		UPDATE commands c SET
			state = CASE WHEN c.state = 'queued' THEN 'delivered' ELSE c.state END,
			delivered_at = $5, deliveries = c.deliveries + 1, updated_at = $5
		FROM pick WHERE c.id = pick.id
		RETURNING c.node_id, c.id, c.kind, c.args, c.deadline, c.retry_safe, c.created_at, c.signature, c.traceparent)
	SELECT ord, NULL::text, false, current, revoked, spec_generation, spec, spec_signature,
		NULL::text, NULL::text, NULL::jsonb, NULL::timestamptz, NULL::bool, NULL::timestamptz, NULL::bytea, NULL::text
	FROM nd
	UNION ALL
	SELECT NULL::bigint, node_id, true, true, false, 0, NULL::jsonb, NULL::bytea,
		id, kind, args, deadline, retry_safe, created_at, signature, traceparent
	FROM upd`

// ClaimSessionDeliveries finds the work of many sessions in one statement
// (claimSessionDeliveriesSQL: one round trip, one snapshot) and returns one
// SessionDelivery per request, in their order. For each request it reads
// whether the session is still its node's live session, whether the node is
// revoked, and the spec when its generation is greater than Known; and it
// claims the node's queued commands, or with InFlight
// also the delivered and running ones, by setting state delivered (running
// stays running), delivered_at = now and deliveries+1. Claiming is
// conditioned on the session being live and the node not revoked in the
// same statement, so a superseded session never takes a newer session's
// commands and a revoked node gets nothing. Commands are locked in id order,
// as ApplySessionCommandUpdates locks them, so concurrent batches do not
// deadlock each other. Of two requests for the same session in one call,
// the first gets its commands (each command is claimed once).
func ClaimSessionDeliveries(ctx context.Context, q DBTX, now time.Time, reqs []ClaimRequest) ([]SessionDelivery, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	ids := make([]string, len(reqs))
	sids := make([]string, len(reqs))
	known := make([]int64, len(reqs))
	inFlight := make([]bool, len(reqs))
	for i, r := range reqs {
		ids[i], sids[i], known[i], inFlight[i] = r.NodeID, r.SessionID, r.Known, r.InFlight
	}
	rows, err := q.Query(ctx, claimSessionDeliveriesSQL, ids, sids, known, inFlight, now)
	if err != nil {
		return nil, interpretError(err)
	}
	defer rows.Close()
	out := make([]SessionDelivery, len(reqs))
	claimed := map[string][]SessionCommand{} // by node
	for rows.Next() {
		var (
			ord     *int64
			node    *string
			command bool
			d       SessionDelivery
			c       SessionCommand
			id      *string
			kind    *string
			safe    *bool
			dl, at  *time.Time
			tp      *string
		)
		if err := rows.Scan(&ord, &node, &command, &d.Current, &d.Revoked, &d.SpecGeneration, &d.Spec, &d.SpecSignature,
			&id, &kind, &c.Args, &dl, &safe, &at, &c.Signature, &tp); err != nil {
			return nil, err
		}
		if !command {
			out[*ord-1] = d
			continue
		}
		c.ID, c.Kind, c.Deadline, c.RetrySafe, c.CreatedAt, c.Traceparent = *id, *kind, *dl, *safe, *at, *tp
		claimed[*node] = append(claimed[*node], c)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError(err)
	}
	// A node's commands go to its first request on its live session (the
	// statement claimed them for its live requests only).
	for i, r := range reqs {
		if cmds := claimed[r.NodeID]; len(cmds) > 0 && out[i].Current && !out[i].Revoked {
			out[i].Commands = cmds
			delete(claimed, r.NodeID)
		}
	}
	for i := range out {
		slices.SortFunc(out[i].Commands, func(a, b SessionCommand) int {
			if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
				return c
			}
			return strings.Compare(a.ID, b.ID)
		})
	}
	return out, nil
}

// ObservedGeneration is a spec generation a daemon reported having applied
// on its node.
type ObservedGeneration struct {
	// NodeID is the reporting node.
	NodeID string
	// Generation is the spec generation it applied.
	Generation int64
}

// RecordSessionObservedGenerations raises each node's observed_generation to
// the greatest generation reported for it in gens (it never lowers it), in
// one statement that locks the nodes in id order (as RecordSessionLastSeen
// does), and returns how many nodes it raised. Unknown nodes are ignored.
func RecordSessionObservedGenerations(ctx context.Context, q DBTX, now time.Time, gens []ObservedGeneration) (int64, error) {
	if len(gens) == 0 {
		return 0, nil
	}
	ids := make([]string, len(gens))
	vals := make([]int64, len(gens))
	for i, g := range gens {
		ids[i], vals[i] = g.NodeID, g.Generation
	}
	tag, err := q.Exec(ctx, `WITH u AS (
			SELECT id, max(gen) AS gen FROM unnest($1::text[], $2::bigint[]) AS u(id, gen) GROUP BY id),
		l AS (SELECT n.id FROM nodes n JOIN u ON u.id = n.id WHERE n.id = ANY($1) AND n.observed_generation < u.gen
			ORDER BY n.id FOR NO KEY UPDATE OF n)
		UPDATE nodes n SET observed_generation = u.gen, updated_at = $3
		FROM u, l WHERE n.id = u.id AND l.id = n.id AND n.observed_generation < u.gen`, ids, vals, now)
	if err != nil {
		return 0, interpretError(err)
	}
	return tag.RowsAffected(), nil
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
		prev AS (SELECT n.id, n.reachable FROM nodes n WHERE n.id = ANY($1) ORDER BY n.id FOR NO KEY UPDATE)
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
		events  []NewEvent
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
			events = append(events, NewEvent{TenantID: owner, Data: NodeReachableData{NodeID: id, SessionID: sid}})
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, interpretError(err)
	}
	if err := WriteEvents(ctx, q, at, events...); err != nil {
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
	// Renewed is the serial (lower-case hex) of the last certificate
	// renewed on the session, which the session's lifetime rests on since;
	// revoked, it makes the session Revoked as well. Empty when none was.
	Renewed string
}

// SessionWork is what PendingSessionWork found for one session.
type SessionWork struct {
	NodeID    string
	SessionID string
	// Superseded is true when the session is no longer the node's live
	// session (or the node is gone).
	Superseded bool
	// Revoked is true when the node or a certificate of the session (its
	// client certificate, or the one renewed on it) is revoked.
	Revoked bool
	// SpecGeneration is the node's desired spec generation.
	SpecGeneration int64
	// ObservedGeneration is the stored observed generation.
	ObservedGeneration int64
	// Queued is true when the node has queued commands.
	Queued bool
}

// pendingSessionWorkSQL is PendingSessionWork's query. Its queued-command
// test names finished_at IS NULL so that it reads the small open-command
// index (commands_open_idx) rather than every command the node ever ran.
const pendingSessionWorkSQL = `SELECT u.id, u.sid,
		n.session_id IS DISTINCT FROM u.sid,
		n.revoked_at IS NOT NULL OR nc.revoked_at IS NOT NULL OR nr.revoked_at IS NOT NULL,
		COALESCE(n.spec_generation, 0), COALESCE(n.observed_generation, 0),
		EXISTS (SELECT 1 FROM commands c WHERE c.node_id = u.id AND c.finished_at IS NULL AND c.state = 'queued')
	FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS u(id, sid, serial, renewed)
	LEFT JOIN nodes n ON n.id = u.id
	LEFT JOIN node_certs nc ON nc.serial = u.serial AND nc.node_id = u.id
	LEFT JOIN node_certs nr ON nr.serial = u.renewed AND nr.node_id = u.id
	WHERE n.session_id IS DISTINCT FROM u.sid
		OR n.revoked_at IS NOT NULL OR nc.revoked_at IS NOT NULL OR nr.revoked_at IS NOT NULL
		OR n.spec_generation > n.observed_generation
		OR EXISTS (SELECT 1 FROM commands c WHERE c.node_id = u.id AND c.finished_at IS NULL AND c.state = 'queued')`

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
	renewed := make([]string, len(sessions))
	for i, s := range sessions {
		ids[i], sids[i], serials[i], renewed[i] = s.NodeID, s.SessionID, s.Serial, s.Renewed
	}
	rows, err := q.Query(ctx, pendingSessionWorkSQL, ids, sids, serials, renewed)
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
