package store

// Command updates from daemons (docs/architecture.md, "Commands"): the
// gateway batches the CommandUpdates of its sessions into one statement that
// moves each command forward, never backward, and writes the events of the
// user commands that ended.

import (
	"context"
	"fmt"
	"slices"
	"time"
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

// cmdRankSQL is cmdRank of c.state (a row of commands c) in SQL.
const cmdRankSQL = `(CASE c.state WHEN 'queued' THEN 0 WHEN 'delivered' THEN 1 WHEN 'running' THEN 2 ELSE 3 END)`

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
	// Now is when the update is recorded: updated_at, delivered_at when
	// unset, and finished_at of a terminal state; a terminal update at or
	// after the command's deadline records it expired.
	Now time.Time
}

// SessionCommandUpdated says what ApplySessionCommandUpdates did with one
// update.
type SessionCommandUpdated struct {
	// Applied is false when the command does not exist, belongs to another
	// node, or is already in this state or a later one (counting the
	// updates before this one in the same call).
	Applied bool
	// Acceptance is true, for an applied update, when the command is the
	// acceptance check of a joining node (purpose 'acceptance'), whose
	// terminal update wakes the controllers.
	Acceptance bool
	// Terminal is true when the update applied a terminal state.
	Terminal bool
	// State is the state recorded for an applied update ("" when not
	// applied): the update's own, except that a terminal update is recorded
	// as expired when it came at or after the deadline or is a failure
	// with CommandErrTextExpired (see ApplySessionCommandUpdates).
	State string
	// Kind and CreatedAt are the applied command's kind and queueing time
	// (for its latency, bc.commands.duration).
	Kind      string
	CreatedAt time.Time
}

// updateGroup is the updates of one command (of one node) in a call of
// ApplySessionCommandUpdates, in their order.
type updateGroup struct {
	items  []int // indexes into the updates
	winner int   // the first update of the highest rank
}

// ApplySessionCommandUpdates applies a batch of daemon updates in q's
// transaction and returns what it did with each, in their order. Each
// command of u.NodeID moves forward to u.State, never backward and never out
// of a terminal state, as if the updates were applied one by one: of several
// updates of one command the first of the highest rank wins, and the result
// and error stored are the winner's (or the command's own when the winner
// has none). A terminal state sets finished_at.
//
// A command must finish before its deadline or it expires, whether or not
// the expiry reconciler (ExpireDueCommands) got to it first: a terminal
// update whose Now is at or after the command's deadline, and a failure
// whose Error is CommandErrTextExpired (the daemon's "received too late";
// daemons cannot report expired) whatever its time, record the command as
// expired. Its error is then "deadline passed" (CommandErrTextExpired for
// such a failure); a late success's result is kept, so the work that was
// done can still be read, but the command did not succeed.
//
// It is one statement: one UPDATE for all commands (those it moves forward
// locked in id order, as ClaimSessionDeliveries locks them; an update that
// moves its command nowhere neither takes nor waits for its lock), the
// command.succeeded, command.failed and command.expired events (data as
// ExpireDueCommands writes them; their hints published after the commit,
// hintEvents) of the user commands that reached
// a terminal state, and one SubjectPokeControllers poke naming the nodes
// whose acceptance check reached one (an expired acceptance check is the
// acceptance reconciler's to retry, as when it expires one); so it runs in q's transaction or, on DB.AutoCommit, in one of
// its own. It fails, writing nothing, for a state a daemon may not report
// (queued, expired, canceled or unknown).
func ApplySessionCommandUpdates(ctx context.Context, q DBTX, updates []SessionCommandUpdate) ([]SessionCommandUpdated, error) {
	out := make([]SessionCommandUpdated, len(updates))
	type key struct{ node, cmd string }
	byKey := make(map[key]int, len(updates))
	var groups []updateGroup
	for i, u := range updates {
		switch u.State {
		case cmdDelivered, cmdRunning, cmdSucceeded, cmdFailed:
		default:
			return nil, fmt.Errorf("update %d of command %s: a daemon cannot move a command to %q", i, u.CommandID, u.State)
		}
		k := key{u.NodeID, u.CommandID}
		g, ok := byKey[k]
		if !ok {
			g = len(groups)
			byKey[k] = g
			groups = append(groups, updateGroup{winner: i})
		}
		groups[g].items = append(groups[g].items, i)
		if cmdRank[u.State] > cmdRank[updates[groups[g].winner].State] {
			groups[g].winner = i
		}
	}
	if len(groups) == 0 {
		return out, nil
	}
	n := len(groups)
	cmds, nodes, states, errs := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	ranks := make([]int32, n)
	results := make([][]byte, n)
	ats := make([]time.Time, n)
	for g, grp := range groups {
		w := updates[grp.winner]
		cmds[g], nodes[g], states[g], errs[g] = w.CommandID, w.NodeID, w.State, w.Error
		ranks[g], results[g], ats[g] = int32(cmdRank[w.State]), w.Result, w.Now
	}
	rows, err := q.Query(ctx, `WITH u AS (
			SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::text[], $7::timestamptz[])
				WITH ORDINALITY AS u(cmd, node, state, rank, result, err, at, ord)),
		old AS (SELECT c.id, c.state, u.ord,
				-- A terminal report at or past the deadline (as ExpireDueCommands
				-- counts it), or the daemon's own "too late to start", expires it.
				u.rank = 3 AND (c.deadline <= u.at OR (u.state = 'failed' AND u.err = $8)) AS expire
			FROM commands c JOIN u ON c.id = u.cmd AND c.node_id = u.node
			-- Only the commands the update moves forward are locked: states
			-- never move back, so one at or past u.rank in the snapshot
			-- stays there, and a locked one that moved there meanwhile is
			-- dropped when its new version is checked.
			WHERE c.id = ANY($1) AND `+cmdRankSQL+` < u.rank ORDER BY c.id FOR UPDATE OF c),
		upd AS (
			UPDATE commands c SET
				state = CASE WHEN old.expire THEN 'expired' ELSE u.state END,
				result = COALESCE(u.result::jsonb, c.result),
				error = CASE WHEN old.expire THEN CASE WHEN u.err = $8 THEN u.err ELSE $9 END
					WHEN u.err = '' THEN c.error ELSE u.err END,
				finished_at = CASE WHEN u.rank = 3 THEN u.at ELSE c.finished_at END,
				delivered_at = COALESCE(c.delivered_at, u.at),
				updated_at = u.at
			FROM old JOIN u ON u.ord = old.ord JOIN nodes n ON n.id = u.node JOIN pools p ON p.id = n.pool_id
			WHERE c.id = old.id
				AND `+cmdRankSQL+` < u.rank
			RETURNING u.ord, old.state AS old_state, c.id, c.node_id, c.state, c.purpose, p.owner_tenant_id AS tenant,
				c.kind, c.error, u.rank, u.at, c.created_at),
		ended AS (
			SELECT ord, tenant, CASE state WHEN 'succeeded' THEN '`+EventCommandSucceeded+`' WHEN 'failed' THEN '`+EventCommandFailed+`'
					ELSE '`+EventCommandExpired+`' END AS type, id AS subject, `+commandEndedDataSQL+` AS data, at
			FROM upd WHERE rank = 3 AND purpose <> 'acceptance'),
		`+eventWriterCTE("ended")+`,
		acc AS (
			INSERT INTO outbox (subject, payload, created_at)
			SELECT '`+SubjectPokeControllers+`',
				convert_to(jsonb_build_object('nodeIds', array_agg(DISTINCT node_id ORDER BY node_id))::text, 'UTF8'), max(at)
			FROM upd WHERE rank = 3 AND purpose = 'acceptance' HAVING count(*) > 0
			RETURNING id)
		SELECT ord, old_state, state, purpose = 'acceptance', kind, created_at, tenant, `+eventCountSQL+`,
			(SELECT count(*) FROM acc) FROM upd`,
		cmds, nodes, states, ranks, results, errs, ats, CommandErrTextExpired, commandErrDeadline)
	if err != nil {
		return nil, interpretError(err)
	}
	type applied struct {
		ord        int64
		old, state string
		acceptance bool
		kind       string
		createdAt  time.Time
		tenant     string
	}
	var done []applied
	var written, poked int64
	for rows.Next() {
		var a applied
		if err := rows.Scan(&a.ord, &a.old, &a.state, &a.acceptance, &a.kind, &a.createdAt, &a.tenant, &written,
			&poked); err != nil {
			rows.Close()
			return nil, err
		}
		done = append(done, a)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, interpretError(err)
	}
	var ended int64
	var hints []string // the ended user commands' events' hints
	for _, a := range done {
		if !a.acceptance && cmdRank[a.state] == cmdRank[cmdSucceeded] {
			ended++
			if h := eventHintSubject(a.tenant, commandEndedEventType[a.state]); h != "" && !slices.Contains(hints, h) {
				hints = append(hints, h)
			}
		}
		grp := groups[a.ord-1]
		// Replay the command's updates in order from its previous state.
		cur := cmdRank[a.old]
		for _, i := range grp.items {
			r := cmdRank[updates[i].State]
			if r <= cur {
				continue
			}
			cur = r
			state := updates[i].State
			if r == cmdRank[cmdSucceeded] {
				// The group's only applied terminal update is its winner,
				// recorded as the statement says (expired when late).
				state = a.state
			}
			out[i] = SessionCommandUpdated{Applied: true, Acceptance: a.acceptance, Terminal: r == cmdRank[cmdSucceeded],
				State: state, Kind: a.kind, CreatedAt: a.createdAt}
		}
	}
	if written != ended {
		return nil, fmt.Errorf("apply command updates: %d events for %d ended commands", written, ended)
	}
	hintEvents(q, hints)
	if poked > 0 {
		if err := signalOutbox(ctx, q); err != nil {
			return nil, err
		}
	}
	return out, nil
}
