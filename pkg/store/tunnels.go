package store

// Tunnels (docs/architecture.md, "Tunnels"): exec tickets and the open
// tunnels they became (tunnel_tickets), the gateways' control URLs
// (gateways), the SSH user CAs every NodeSpec carries (ssh_user_cas), and
// the nodes' refused SSH logins (node.ssh_refused).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// TunnelStale is how long an open tunnel counts against the limits without
// being authorized again (TouchTunnel): its API replica re-authorizes every
// minute, so a row older than this is a replica's that died.
const TunnelStale = 2 * time.Minute

// TunnelTicket is a row of tunnel_tickets: an exec ticket, and once consumed
// the tunnel it opened.
type TunnelTicket struct {
	// ID is "tkt_…".
	ID string
	// NodeID, Purpose ("shell" or "ssh"), TenantID and TokenID are what the
	// ticket is bound to; ReservationID is the sandbox's reservation, ""
	// for a shell or break-glass SSH.
	NodeID, Purpose, TenantID, TokenID, ReservationID string
	CreatedAt, ExpiresAt                              time.Time
	// ConsumedAt is when the ticket opened its tunnel; AuthorizedAt when
	// the tunnel was last authorized; ClosedAt when it closed, with
	// CloseReason. Nil until then.
	ConsumedAt, AuthorizedAt, ClosedAt *time.Time
	CloseReason                        string
}

const tunnelTicketColumns = `id, node_id, purpose, tenant_id, token_id, COALESCE(reservation_id, ''), created_at, expires_at,
	consumed_at, authorized_at, closed_at, close_reason`

func scanTunnelTicket(row pgx.Row) (TunnelTicket, error) {
	var t TunnelTicket
	err := row.Scan(&t.ID, &t.NodeID, &t.Purpose, &t.TenantID, &t.TokenID, &t.ReservationID, &t.CreatedAt, &t.ExpiresAt,
		&t.ConsumedAt, &t.AuthorizedAt, &t.ClosedAt, &t.CloseReason)
	return t, err
}

// CreateTunnelTicket records exec ticket t (unconsumed). Call it in the
// transaction of the caller's audit row.
func CreateTunnelTicket(ctx context.Context, q DBTX, t TunnelTicket) error {
	_, err := q.Exec(ctx, `INSERT INTO tunnel_tickets (id, node_id, purpose, tenant_id, token_id, reservation_id, created_at,
			expires_at)
		VALUES ($1, $2, $3, $4, $5, NULLIF($6, ''), $7, $8)`, t.ID, t.NodeID, t.Purpose, t.TenantID, t.TokenID,
		t.ReservationID, t.CreatedAt, t.ExpiresAt)
	if err != nil {
		return queryErr("create tunnel ticket", err)
	}
	return nil
}

// GetTunnelTicket returns ticket id. Errors: ErrNotFound.
func GetTunnelTicket(ctx context.Context, q DBTX, id string) (TunnelTicket, error) {
	t, err := scanTunnelTicket(q.QueryRow(ctx, `SELECT `+tunnelTicketColumns+` FROM tunnel_tickets WHERE id = $1`, id))
	if err != nil {
		return TunnelTicket{}, queryErr("tunnel ticket "+id, err)
	}
	return t, nil
}

// TunnelLimits caps the tunnels open at once (0: no cap).
type TunnelLimits struct {
	PerNode, PerToken int
}

// Errors of ConsumeTunnelTicket.
var (
	// ErrTicketUsed: the ticket opened a tunnel already.
	ErrTicketUsed = errors.New("ticket was used already")
	// ErrTicketExpired: the ticket's minute is over.
	ErrTicketExpired = errors.New("ticket expired")
	// ErrTunnelLimit: the node or the token has as many tunnels open as
	// the limits allow; errors.As a *TunnelLimitError for which.
	ErrTunnelLimit = errors.New("too many open tunnels")
)

// TunnelLimitError says which limit refused a tunnel. It matches
// ErrTunnelLimit under errors.Is.
type TunnelLimitError struct {
	// Of is "node" or "token".
	Of    string
	Limit int
}

func (e *TunnelLimitError) Error() string {
	return fmt.Sprintf("the %s has %d open tunnels, the most allowed", e.Of, e.Limit)
}

// Is makes errors.Is(err, ErrTunnelLimit) true.
func (e *TunnelLimitError) Is(target error) bool { return target == ErrTunnelLimit }

// ConsumeTunnelTicket marks ticket id consumed and authorized at now, once:
// the tunnel it opens is open from then on. It locks the ticket, then counts
// the tunnels open on its node and of its token (consumed, not closed,
// authorized within TunnelStale), refusing one over limits. Call it in a
// transaction. Errors: ErrNotFound, ErrTicketUsed, ErrTicketExpired, a
// *TunnelLimitError (ErrTunnelLimit); nothing changes then.
func ConsumeTunnelTicket(ctx context.Context, q DBTX, id string, now time.Time, limits TunnelLimits) (TunnelTicket, error) {
	t, err := scanTunnelTicket(q.QueryRow(ctx, `SELECT `+tunnelTicketColumns+` FROM tunnel_tickets WHERE id = $1 FOR UPDATE`, id))
	if err != nil {
		return TunnelTicket{}, queryErr("tunnel ticket "+id, err)
	}
	switch {
	case t.ConsumedAt != nil:
		return TunnelTicket{}, ErrTicketUsed
	case !now.Before(t.ExpiresAt):
		return TunnelTicket{}, ErrTicketExpired
	}
	var onNode, ofToken int
	err = q.QueryRow(ctx, `SELECT count(*) FILTER (WHERE node_id = $1), count(*) FILTER (WHERE token_id = $2)
		FROM tunnel_tickets WHERE (node_id = $1 OR token_id = $2) AND consumed_at IS NOT NULL AND closed_at IS NULL
			AND authorized_at > $3`, t.NodeID, t.TokenID, now.Add(-TunnelStale)).Scan(&onNode, &ofToken)
	if err != nil {
		return TunnelTicket{}, queryErr("count open tunnels", err)
	}
	switch {
	case limits.PerNode > 0 && onNode >= limits.PerNode:
		return TunnelTicket{}, &TunnelLimitError{Of: "node", Limit: limits.PerNode}
	case limits.PerToken > 0 && ofToken >= limits.PerToken:
		return TunnelTicket{}, &TunnelLimitError{Of: "token", Limit: limits.PerToken}
	}
	if _, err := q.Exec(ctx, `UPDATE tunnel_tickets SET consumed_at = $2, authorized_at = $2 WHERE id = $1`, id, now); err != nil {
		return TunnelTicket{}, queryErr("consume tunnel ticket", err)
	}
	t.ConsumedAt, t.AuthorizedAt = &now, &now
	return t, nil
}

// TouchTunnel records that open tunnel id was authorized again at now.
func TouchTunnel(ctx context.Context, q DBTX, id string, now time.Time) error {
	if _, err := q.Exec(ctx, `UPDATE tunnel_tickets SET authorized_at = $2 WHERE id = $1 AND closed_at IS NULL`, id, now); err != nil {
		return queryErr("touch tunnel", err)
	}
	return nil
}

// CloseTunnel records that tunnel id closed at now with reason (the first
// close's stands).
func CloseTunnel(ctx context.Context, q DBTX, id string, now time.Time, reason string) error {
	if _, err := q.Exec(ctx, `UPDATE tunnel_tickets SET closed_at = $2, close_reason = left($3, 1024)
		WHERE id = $1 AND closed_at IS NULL`, id, now, reason); err != nil {
		return queryErr("close tunnel", err)
	}
	return nil
}

// RegisterGateway records gateway id's control URL (where the API opens
// tunnels through it), at its start.
func RegisterGateway(ctx context.Context, q DBTX, id, controlURL string, now time.Time) error {
	if _, err := q.Exec(ctx, `INSERT INTO gateways (id, control_url, updated_at) VALUES ($1, $2, $3)
		ON CONFLICT (id) DO UPDATE SET control_url = EXCLUDED.control_url, updated_at = EXCLUDED.updated_at`,
		id, controlURL, now); err != nil {
		return queryErr("register gateway "+id, err)
	}
	return nil
}

// TunnelRoute is where a node's tunnels go: the gateway holding its live
// session.
type TunnelRoute struct {
	// GatewayID is the gateway of the node's session, "" when it has none.
	GatewayID string
	// ControlURL is that gateway's control URL, "" when it registered none.
	ControlURL string
	// Present is whether that gateway's presence is unexpired at now.
	Present bool
}

// NodeTunnelRoute returns the route of node id's tunnels at now. Errors:
// ErrNotFound.
func NodeTunnelRoute(ctx context.Context, q DBTX, id string, now time.Time) (TunnelRoute, error) {
	var r TunnelRoute
	err := q.QueryRow(ctx, `SELECT COALESCE(n.gateway_id, ''), COALESCE(g.control_url, ''),
			COALESCE(l.expires_at > $2, false)
		FROM nodes n LEFT JOIN gateways g ON g.id = n.gateway_id
			LEFT JOIN leases l ON l.name = '`+gatewayPresencePrefix+`' || n.gateway_id
		WHERE n.id = $1`, id, now).Scan(&r.GatewayID, &r.ControlURL, &r.Present)
	if err != nil {
		return TunnelRoute{}, queryErr("node "+id, err)
	}
	return r, nil
}

// SSHUserCAs returns the SSH user CAs every NodeSpec carries, by name.
func SSHUserCAs(ctx context.Context, q DBTX) ([]*gatewayv1.SshUserCa, error) {
	rows, err := q.Query(ctx, sshUserCAsSQL)
	if err != nil {
		return nil, queryErr("ssh user CAs", err)
	}
	return collectSSHUserCAs(rows)
}

// sshUserCAsSQL reads the SSH user CAs by name (collectSSHUserCAs).
const sshUserCAsSQL = `SELECT name, public_key FROM ssh_user_cas ORDER BY name`

func collectSSHUserCAs(rows pgx.Rows) ([]*gatewayv1.SshUserCa, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (*gatewayv1.SshUserCa, error) {
		ca := &gatewayv1.SshUserCa{}
		return ca, r.Scan(&ca.Name, &ca.PublicKey)
	})
}

// SetSSHUserCAs makes the SSH user CAs exactly cas (by name) at now, and
// when that changes them, gives every adopted node the next spec
// generation carrying them (signed by signer; RebuildNodeSpecs), in q's
// transaction. It reports whether they changed: a rotation is a new spec
// generation on every node.
func SetSSHUserCAs(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, cas []*gatewayv1.SshUserCa) (bool, error) {
	cur, err := SSHUserCAs(ctx, q)
	if err != nil {
		return false, err
	}
	want := slices.Clone(cas)
	slices.SortFunc(want, func(a, b *gatewayv1.SshUserCa) int { return compareStrings(a.GetName(), b.GetName()) })
	if slices.EqualFunc(cur, want, func(a, b *gatewayv1.SshUserCa) bool { return proto.Equal(a, b) }) {
		return false, nil
	}
	// One statement at a time: the lock of the table orders concurrent
	// callers (two controllers replicas starting together).
	if _, err := q.Exec(ctx, `LOCK TABLE ssh_user_cas IN EXCLUSIVE MODE`); err != nil {
		return false, queryErr("set ssh user CAs", err)
	}
	if _, err := q.Exec(ctx, `DELETE FROM ssh_user_cas`); err != nil {
		return false, queryErr("set ssh user CAs", err)
	}
	for _, ca := range want {
		if _, err := q.Exec(ctx, `INSERT INTO ssh_user_cas (name, public_key, updated_at) VALUES ($1, $2, $3)`,
			ca.GetName(), ca.GetPublicKey(), now); err != nil {
			return false, queryErr("set ssh user CAs", err)
		}
	}
	nodes, err := queryIDs(ctx, q, "adopted nodes", `SELECT id FROM nodes WHERE provision_state = 'adopted' AND revoked_at IS NULL
		ORDER BY id`)
	if err != nil {
		return false, err
	}
	if _, err := RebuildNodeSpecs(ctx, q, signer, now, nodes); err != nil {
		return false, err
	}
	return true, nil
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// withSSHUserCAs returns spec (protojson of a NodeSpec) carrying cas.
func withSSHUserCAs(spec []byte, cas []*gatewayv1.SshUserCa) ([]byte, error) {
	ns := &gatewayv1.NodeSpec{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(spec, ns); err != nil {
		return nil, fmt.Errorf("node spec: %w", err)
	}
	ns.SshUserCas = cas
	return protojson.Marshal(ns)
}

// SSHRefusal is a login a node's SSH server refused.
type SSHRefusal struct {
	NodeID, Reason, KeyID, User string
}

// RecordSSHRefused writes a node.ssh_refused event for the tenant owning
// the node's pool: its SSH server refused a login (r's reason, the
// certificate's key id and the user). Errors: ErrNotFound.
func RecordSSHRefused(ctx context.Context, q DBTX, now time.Time, r SSHRefusal) error {
	return writeEventsOfNodes(ctx, q, now, []string{r.NodeID}, func(string) EventData {
		return NodeSSHRefusedData(r)
	})
}
