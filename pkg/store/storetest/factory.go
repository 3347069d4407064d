package storetest

// The factory: rows for tests, one function per kind of row, each taking a
// test database (New) and options whose zero fields get defaults, and
// returning the row as the store reads it back (river's testfactory is the
// model). A row that a store function inserts without side effects is
// inserted by that function (store.CreateTenant, CreateSite, CreatePool,
// UpsertOffer, CreateNode, CreateNodeCert, CreateAPIToken,
// CreateJoinToken); what else a test asks for (a provision state, a
// session, a command's or reservation's state) is then written to the row
// as it is. The factory makes rows, not histories: the store's transitions
// (AdoptNodes, QueueCommand, CreateReservation, PlaceReservations, …)
// also write events, outbox messages, hints and audit rows, which a fixture must
// not; a test of a transition calls it.
//
// A parent left empty in the options (the pool of a node, the site and
// owner of a pool) is made with defaults. Names are unique per process
// ("tenant-7"), so fixtures of one database never collide.

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

// seq numbers the names the factory makes up.
var seq atomic.Int64

// uniqueName returns prefix-<n>, a name no other call returns.
func uniqueName(prefix string) string { return fmt.Sprintf("%s-%d", prefix, seq.Add(1)) }

// or returns v, or def when v is the zero value.
func or[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// orNew returns id, or the id of a row newRow makes when id is empty.
func orNew(id string, newRow func() string) string {
	if id != "" {
		return id
	}
	return newRow()
}

// orNow returns at, or db's time when at is zero.
func orNow(db *store.DB, at time.Time) time.Time {
	if at.IsZero() {
		return db.Now()
	}
	return at
}

// nullTime is at, or nil (SQL NULL) when at is zero.
func nullTime(at time.Time) *time.Time {
	if at.IsZero() {
		return nil
	}
	return &at
}

// TenantOpts are the options of Tenant; zero fields get defaults.
type TenantOpts struct {
	// ID defaults to a new "ten_…" id.
	ID string
	// Name defaults to a unique "tenant-<n>".
	Name string
	// ParentID is the parent tenant, none by default.
	ParentID  string
	CreatedAt time.Time
}

// Tenant inserts a tenant (store.CreateTenant) and returns it.
func Tenant(t testing.TB, db *store.DB, opts *TenantOpts) store.Tenant {
	t.Helper()
	o := ptrOr(opts)
	at := orNow(db, o.CreatedAt)
	id := or(o.ID, ids.New(ids.Tenant, at))
	require.NoError(t, store.CreateTenant(t.Context(), db.Pool, store.Tenant{ID: id, Name: or(o.Name, uniqueName("tenant")),
		ParentID: o.ParentID, CreatedAt: at}))
	out, err := store.GetTenant(t.Context(), db.Pool, id)
	require.NoError(t, err)
	return out
}

// SiteOpts are the options of Site; zero fields get defaults.
type SiteOpts struct {
	// ID defaults to a new "site_…" id.
	ID string
	// Name defaults to a unique "site-<n>"; Region is none by default.
	Name, Region string
	CreatedAt    time.Time
}

// Site inserts a site (store.CreateSite) and returns it.
func Site(t testing.TB, db *store.DB, opts *SiteOpts) store.Site {
	t.Helper()
	o := ptrOr(opts)
	at := orNow(db, o.CreatedAt)
	id := or(o.ID, ids.New(ids.Site, at))
	require.NoError(t, store.CreateSite(t.Context(), db.Pool, store.Site{ID: id, Name: or(o.Name, uniqueName("site")), Region: o.Region,
		CreatedAt: at}))
	out, err := store.GetSite(t.Context(), db.Pool, id)
	require.NoError(t, err)
	return out
}

// PoolOpts are the options of Pool; zero fields get defaults.
type PoolOpts struct {
	// ID defaults to a new "pool_…" id.
	ID string
	// SiteID and OwnerTenantID default to a new site and a new tenant.
	SiteID, OwnerTenantID string
	// Name defaults to a unique "pool-<n>", Kind to "metal-host".
	Name, Kind string
	// GPUModel and ExpectGPUCount are the acceptance rules, none by
	// default.
	GPUModel       string
	ExpectGPUCount int32
	CreatedAt      time.Time
}

// Pool inserts a pool (store.CreatePool) and returns it.
func Pool(t testing.TB, db *store.DB, opts *PoolOpts) store.Pool {
	t.Helper()
	o := ptrOr(opts)
	o.SiteID = orNew(o.SiteID, func() string { return Site(t, db, nil).ID })
	o.OwnerTenantID = orNew(o.OwnerTenantID, func() string { return Tenant(t, db, nil).ID })
	at := orNow(db, o.CreatedAt)
	id := or(o.ID, ids.New(ids.Pool, at))
	require.NoError(t, store.CreatePool(t.Context(), db.Pool, store.Pool{ID: id, SiteID: o.SiteID, OwnerTenantID: o.OwnerTenantID,
		Name: or(o.Name, uniqueName("pool")), Kind: or(o.Kind, "metal-host"), GPUModel: o.GPUModel, ExpectGPUCount: o.ExpectGPUCount,
		CreatedAt: at}))
	out, err := store.GetPool(t.Context(), db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return out
}

// OfferOpts are the options of Offer; PoolID and TenantID are required.
type OfferOpts struct {
	PoolID, TenantID string
	// GPUQuota is how many GPUs the tenant may hold in the pool.
	GPUQuota int32
}

// Offer offers a pool to a tenant (store.UpsertOffer) and returns the
// offer.
func Offer(t testing.TB, db *store.DB, opts *OfferOpts) store.Offer {
	t.Helper()
	now := db.Now()
	out, err := store.UpsertOffer(t.Context(), db.Pool, store.AllTenants, store.Offer{PoolID: opts.PoolID, TenantID: opts.TenantID,
		GPUQuota: opts.GPUQuota, CreatedAt: now, UpdatedAt: now})
	require.NoError(t, err)
	return out
}

// DefaultGPUModel is the model of the GPUs NodeOpts.GPUs makes.
const DefaultGPUModel = "NVIDIA H100 80GB HBM3"

// NodeOpts are the options of Node; zero fields get defaults, and a node
// is joining, unreachable, without a session, spec or GPUs unless they say
// otherwise.
type NodeOpts struct {
	// ID defaults to a new "node_…" id.
	ID string
	// PoolID defaults to a new pool.
	PoolID string
	// The machine's claims, and the join token it joined with.
	Hostname, MachineID, Variant, AgentVersion, JoinTokenID string
	// State is the provision state (store.NodeJoining by default) and
	// Reason its reason.
	State, Reason string
	// GatewayID and SessionID are the node's live session, none by
	// default; BootID is the boot its daemon said hello from.
	GatewayID, SessionID, BootID string
	Reachable                    bool
	// LastSeen is when the node was last heard, never by default.
	LastSeen time.Time
	// Cordoned and CordonReason are the node's cordon.
	Cordoned     bool
	CordonReason string
	// SpecGeneration, ObservedGeneration and Spec (protojson of a
	// gatewayv1.NodeSpec; "{}" by default) are the node's desired state,
	// SpecSignature its signature (none by default).
	SpecGeneration, ObservedGeneration int64
	Spec                               string
	SpecSignature                      []byte
	// GPUs is how many healthy GPUs the node has, indexes 0…, uuids
	// "GPU-<node id>-<index>", of GPUModel (DefaultGPUModel by default)
	// with GPUMemoryBytes. Devices, when set, are the node's GPUs instead
	// (their NodeID is ignored).
	GPUs           int
	GPUModel       string
	GPUMemoryBytes int64
	Devices        []store.NodeDevice
	// AdoptedAt and RevokedAt are when the node was adopted and revoked,
	// never by default. RevokeReason goes with RevokedAt.
	AdoptedAt, RevokedAt time.Time
	RevokeReason         string
	// CreatedAt is also its updated_at.
	CreatedAt time.Time
}

// Node inserts a node (store.CreateNode), writes the state opts ask for to
// its row, inserts its GPUs, and returns it as store.GetNode reads it.
func Node(t testing.TB, db *store.DB, opts *NodeOpts) store.Node {
	t.Helper()
	ctx := t.Context()
	o := ptrOr(opts)
	o.PoolID = orNew(o.PoolID, func() string { return Pool(t, db, nil).ID })
	at := orNow(db, o.CreatedAt)
	id := or(o.ID, ids.New(ids.Node, at))
	// One transaction: a reconciler running beside the test sees the node
	// only as the options make it, never as a joining node first (it would
	// start acceptance on it, and the state written after would undo that).
	err := db.InTx(ctx, func(tx pgx.Tx) error {
		if err := store.CreateNode(ctx, tx, store.NewNode{ID: id, PoolID: o.PoolID, JoinTokenID: o.JoinTokenID,
			Hostname: o.Hostname, MachineID: o.MachineID, Variant: o.Variant, AgentVersion: o.AgentVersion, CreatedAt: at}); err != nil {
			return err
		}
		// What no store function sets without an event or the flows before it.
		_, err := tx.Exec(ctx, `UPDATE nodes SET provision_state = $2, provision_reason = $3,
			gateway_id = NULLIF($4, ''), session_id = NULLIF($5, ''), reachable = $6, last_seen = $7, cordoned = $8,
			cordon_reason = $9, spec_generation = $10, observed_generation = $11, spec = COALESCE(NULLIF($12, '')::jsonb, spec),
			adopted_at = $13, revoked_at = $14, revoke_reason = $15, boot_id = $16, spec_signature = $17
		WHERE id = $1`, id, or(o.State, store.NodeJoining), o.Reason, o.GatewayID, o.SessionID, o.Reachable, nullTime(o.LastSeen),
			o.Cordoned, o.CordonReason, o.SpecGeneration, o.ObservedGeneration, o.Spec, nullTime(o.AdoptedAt), nullTime(o.RevokedAt),
			o.RevokeReason, o.BootID, o.SpecSignature)
		if err != nil {
			return err
		}
		devices := o.Devices
		if devices == nil {
			for i := range o.GPUs {
				devices = append(devices, store.NodeDevice{Index: int32(i), UUID: fmt.Sprintf("GPU-%s-%d", id, i),
					Model: or(o.GPUModel, DefaultGPUModel), MemoryBytes: o.GPUMemoryBytes, Healthy: true})
			}
		}
		return insertDevices(ctx, tx, id, devices)
	})
	require.NoError(t, err)
	out, err := store.GetNode(ctx, db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return out
}

// insertDevices inserts devices as GPUs of node id.
func insertDevices(ctx context.Context, q store.DBTX, id string, devices []store.NodeDevice) error {
	if len(devices) == 0 {
		return nil
	}
	var (
		index       []int32
		uuid, model []string
		memory      []int64
		healthy     []bool
		nodeIDs     []string
	)
	for _, d := range devices {
		nodeIDs, index, uuid, model = append(nodeIDs, id), append(index, d.Index), append(uuid, d.UUID), append(model, d.Model)
		memory, healthy = append(memory, d.MemoryBytes), append(healthy, d.Healthy)
	}
	_, err := q.Exec(ctx, `INSERT INTO node_devices (node_id, device_index, uuid, model, memory_bytes, healthy)
		SELECT * FROM unnest($1::text[], $2::int[], $3::text[], $4::text[], $5::bigint[], $6::bool[])`,
		nodeIDs, index, uuid, model, memory, healthy)
	return err
}

// NodeCertOpts are the options of NodeCert; NodeID is required.
type NodeCertOpts struct {
	NodeID string
	// Serial defaults to a unique lower-case hex serial.
	Serial string
	// PublicKeySHA256 defaults to the SHA-256 of the serial.
	PublicKeySHA256 []byte
	// NotBefore and NotAfter default to now and a day later.
	NotBefore, NotAfter time.Time
	// RevokedAt is when the certificate was revoked, never by default.
	RevokedAt time.Time
	CreatedAt time.Time
}

// NodeCert records a node certificate (store.CreateNodeCert), revoked
// when opts say so, and returns it as a session sees it
// (store.GetSessionCert).
func NodeCert(t testing.TB, db *store.DB, opts *NodeCertOpts) store.SessionCert {
	t.Helper()
	ctx := t.Context()
	at := orNow(db, opts.CreatedAt)
	serial := or(opts.Serial, fmt.Sprintf("%x", 0xc0de0000+seq.Add(1)))
	notBefore := or(opts.NotBefore, at)
	require.NoError(t, store.CreateNodeCert(ctx, db.Pool, store.NewNodeCert{Serial: serial, NodeID: opts.NodeID, PublicKeySHA256: hashOr(opts.PublicKeySHA256, serial),
		NotBefore: notBefore, NotAfter: or(opts.NotAfter, notBefore.Add(24*time.Hour)), CreatedAt: at}))
	if !opts.RevokedAt.IsZero() {
		// A revoked certificate of a node that is not: RevokeNode revokes
		// them all with the node.
		_, err := db.Pool.Exec(ctx, `UPDATE node_certs SET revoked_at = $2 WHERE serial = $1`, serial, opts.RevokedAt)
		require.NoError(t, err)
	}
	out, err := store.GetSessionCert(ctx, db.Pool, serial)
	require.NoError(t, err)
	return out
}

// CommandOpts are the options of Command; NodeID is required, other zero
// fields get defaults.
type CommandOpts struct {
	// ID defaults to a new "cmd_…" id.
	ID     string
	NodeID string
	// Kind defaults to store.CommandDiagNVML, Args (JSON) to {}, Purpose to
	// "user", State to "queued".
	Kind, Args, Purpose, State string
	// RetrySafe defaults to the kind's (store.CommandRetrySafe).
	RetrySafe *bool
	// Deadline defaults to an hour after CreatedAt.
	Deadline time.Time
	// Result (JSON) and Error are what the daemon reported, none by
	// default.
	Result, Error string
	// Deliveries counts the deliveries.
	Deliveries int32
	RequestID  string
	CreatedBy  string
	// CreatedAt is also its updated_at.
	CreatedAt time.Time
	// DeliveredAt is never by default; FinishedAt defaults to CreatedAt for
	// a terminal State (and is never for an open one).
	DeliveredAt, FinishedAt time.Time
	// Signature is the command-signing root's, none by default.
	Signature []byte
}

// Command inserts a command in any state and returns it. It writes the row
// alone: store.QueueCommand, which queues a user command, also writes its
// event, pokes its gateway and checks its node.
func Command(t testing.TB, db *store.DB, opts *CommandOpts) store.Command {
	t.Helper()
	at := orNow(db, opts.CreatedAt)
	id := or(opts.ID, ids.New(ids.Command, at))
	kind := or(opts.Kind, store.CommandDiagNVML)
	safe, _ := store.CommandRetrySafe(kind)
	if opts.RetrySafe != nil {
		safe = *opts.RetrySafe
	}
	state := or(opts.State, "queued")
	finished := opts.FinishedAt
	if finished.IsZero() && state != "queued" && state != "delivered" && state != "running" {
		finished = at
	}
	var result *string
	if opts.Result != "" {
		result = &opts.Result
	}
	_, err := db.Pool.Exec(t.Context(), `INSERT INTO commands (id, node_id, kind, args, purpose, state, retry_safe, deadline,
			result, error, deliveries, request_id, created_by, created_at, updated_at, delivered_at, finished_at, signature)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, NULLIF($12, ''), $13, $14, $14, $15, $16, $17)`,
		id, opts.NodeID, kind, or(opts.Args, "{}"), or(opts.Purpose, "user"), state, safe, or(opts.Deadline, at.Add(time.Hour)),
		result, opts.Error, opts.Deliveries, opts.RequestID, opts.CreatedBy, at, nullTime(opts.DeliveredAt), nullTime(finished),
		opts.Signature)
	require.NoError(t, err)
	out, err := store.GetCommand(t.Context(), db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return out
}

// ReservationOpts are the options of Reservation; TenantID and PoolID are
// required, other zero fields get defaults.
type ReservationOpts struct {
	// ID defaults to a new "res_…" id.
	ID               string
	TenantID, PoolID string
	// GPUs defaults to 1.
	GPUs int32
	// StartAt and EndAt default to CreatedAt and an hour later.
	StartAt, EndAt time.Time
	// State defaults to store.ReservationPending; Reason is its reason.
	State, Reason string
	// NodeID is the node it is placed on, none by default. DeviceIndexes
	// are its bookings of that node's devices, over BookedFrom (StartAt by
	// default) to EndAt.
	NodeID        string
	DeviceIndexes []int32
	BookedFrom    time.Time
	// Binding is the CDI device names the daemon reported bound.
	Binding []string
	// SpecGeneration is the spec generation that first carried it, none
	// by default.
	SpecGeneration int64
	RequestID      string
	CreatedBy      string
	// CreatedAt is also its updated_at.
	CreatedAt time.Time
	// PlacedAt, ActiveAt and EndedAt are never by default.
	PlacedAt, ActiveAt, EndedAt time.Time
}

// Reservation inserts a reservation in any state with its bookings, and
// returns it. It writes the rows alone: store.CreateReservation, the
// tenant's Reserve, also checks the offer and quota, writes the event and
// pokes the scheduler; store.PlaceReservations also rebuilds the node's
// spec (call store.RebuildNodeSpecs for a placed fixture that needs it).
func Reservation(t testing.TB, db *store.DB, opts *ReservationOpts) store.Reservation {
	t.Helper()
	ctx := t.Context()
	at := orNow(db, opts.CreatedAt)
	id := or(opts.ID, ids.New(ids.Reservation, at))
	start := or(opts.StartAt, at)
	end := or(opts.EndAt, start.Add(time.Hour))
	binding := opts.Binding
	if binding == nil {
		binding = []string{}
	}
	var specGen *int64
	if opts.SpecGeneration != 0 {
		specGen = &opts.SpecGeneration
	}
	_, err := db.Pool.Exec(ctx, `INSERT INTO reservations (id, tenant_id, pool_id, gpus, start_at, end_at, state, reason,
			node_id, binding, spec_generation, request_id, created_by, created_at, updated_at, placed_at, active_at, ended_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, NULLIF($9, ''), $10, $11, NULLIF($12, ''), $13, $14, $14, $15, $16, $17)`,
		id, opts.TenantID, opts.PoolID, or(opts.GPUs, 1), start, end, or(opts.State, store.ReservationPending), opts.Reason,
		opts.NodeID, binding, specGen, opts.RequestID, opts.CreatedBy, at, nullTime(opts.PlacedAt), nullTime(opts.ActiveAt),
		nullTime(opts.EndedAt))
	require.NoError(t, err)
	if len(opts.DeviceIndexes) > 0 {
		Booking(t, db, &BookingOpts{ReservationID: id, NodeID: opts.NodeID, DeviceIndexes: opts.DeviceIndexes,
			Lower: or(opts.BookedFrom, start), Upper: end})
	}
	out, err := store.GetReservation(ctx, db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return out
}

// BookingOpts are the options of Booking; every field is required.
type BookingOpts struct {
	ReservationID, NodeID string
	// DeviceIndexes are the booked devices of the node, one booking each.
	DeviceIndexes []int32
	// Lower and Upper bound the bookings: [Lower, Upper).
	Lower, Upper time.Time
}

// Booking books devices of a node for a reservation and returns the
// bookings. It writes the rows alone: store.PlaceReservations, the
// scheduler's, also moves the reservation to binding and rebuilds the
// node's spec. The bookings' exclusion constraint (I1) holds as ever.
func Booking(t testing.TB, db *store.DB, opts *BookingOpts) []store.BookedInterval {
	t.Helper()
	n := len(opts.DeviceIndexes)
	res, nodes, lower, upper := make([]string, n), make([]string, n), make([]time.Time, n), make([]time.Time, n)
	out := make([]store.BookedInterval, n)
	for i, d := range opts.DeviceIndexes {
		res[i], nodes[i], lower[i], upper[i] = opts.ReservationID, opts.NodeID, opts.Lower, opts.Upper
		out[i] = store.BookedInterval{NodeID: opts.NodeID, DeviceIndex: d, Lower: opts.Lower, Upper: opts.Upper}
	}
	_, err := db.Pool.Exec(t.Context(), `INSERT INTO bookings (reservation_id, node_id, device_index, during)
		SELECT u.res, u.node, u.dev, tstzrange(u.lo, u.hi, '[)')
		FROM unnest($1::text[], $2::text[], $3::int[], $4::timestamptz[], $5::timestamptz[]) AS u(res, node, dev, lo, hi)`,
		res, nodes, opts.DeviceIndexes, lower, upper)
	require.NoError(t, err)
	return out
}

// APITokenOpts are the options of APIToken; zero fields get defaults.
type APITokenOpts struct {
	// ID defaults to a new "tok_…" id.
	ID string
	// TenantID defaults to a new tenant.
	TenantID string
	// Name defaults to a unique "token-<n>", Role to "tenant-member".
	Name, Role string
	// Hash defaults to the SHA-256 of the id (the token's secret is never
	// known then: mint one with iam.MintAPIToken to use it).
	Hash []byte
	// ExpiresAt, RevokedAt and LastUsedAt are never by default.
	ExpiresAt, RevokedAt, LastUsedAt time.Time
	CreatedAt                        time.Time
}

// APIToken inserts an API token (store.CreateAPIToken), revoked or used
// when opts say so, and returns it.
func APIToken(t testing.TB, db *store.DB, opts *APITokenOpts) store.APIToken {
	t.Helper()
	ctx := t.Context()
	o := ptrOr(opts)
	o.TenantID = orNew(o.TenantID, func() string { return Tenant(t, db, nil).ID })
	at := orNow(db, o.CreatedAt)
	id := or(o.ID, ids.New(ids.APIToken, at))
	require.NoError(t, store.CreateAPIToken(ctx, db.Pool, store.APIToken{ID: id, TenantID: o.TenantID, Name: or(o.Name, uniqueName("token")),
		Hash: hashOr(o.Hash, id), Role: or(o.Role, "tenant-member"), ExpiresAt: nullTime(o.ExpiresAt), CreatedAt: at}))
	if !o.RevokedAt.IsZero() || !o.LastUsedAt.IsZero() {
		// store.RevokeAPIToken also tells the API servers (an outbox
		// message); a fixture is revoked already.
		_, err := db.Pool.Exec(ctx, `UPDATE api_tokens SET revoked_at = $2, last_used_at = $3 WHERE id = $1`, id,
			nullTime(o.RevokedAt), nullTime(o.LastUsedAt))
		require.NoError(t, err)
	}
	out, err := store.GetAPIToken(ctx, db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return out
}

// JoinTokenOpts are the options of JoinToken; zero fields get defaults.
type JoinTokenOpts struct {
	// ID defaults to a new "jt_…" id.
	ID string
	// PoolID defaults to a new pool.
	PoolID string
	// Hash defaults to the SHA-256 of the id.
	Hash []byte
	// MaxUses defaults to 1; Uses is how many were taken.
	MaxUses, Uses int32
	// ExpiresAt defaults to a day after CreatedAt; RevokedAt is never by
	// default.
	ExpiresAt, RevokedAt time.Time
	CreatedBy            string
	CreatedAt            time.Time
}

// JoinToken inserts a join token (store.CreateJoinToken), used or revoked
// when opts say so, and returns it.
func JoinToken(t testing.TB, db *store.DB, opts *JoinTokenOpts) store.JoinToken {
	t.Helper()
	ctx := t.Context()
	o := ptrOr(opts)
	o.PoolID = orNew(o.PoolID, func() string { return Pool(t, db, nil).ID })
	at := orNow(db, o.CreatedAt)
	id := or(o.ID, ids.New(ids.JoinToken, at))
	require.NoError(t, store.CreateJoinToken(ctx, db.Pool, store.AllTenants, store.JoinToken{ID: id, PoolID: o.PoolID, Hash: hashOr(o.Hash, id),
		MaxUses: or(o.MaxUses, 1), ExpiresAt: or(o.ExpiresAt, at.Add(24*time.Hour)), CreatedBy: o.CreatedBy, CreatedAt: at}))
	if o.Uses != 0 || !o.RevokedAt.IsZero() {
		// Uses are counted by joins (store.UseJoinToken), one at a time.
		_, err := db.Pool.Exec(ctx, `UPDATE join_tokens SET uses = $2, revoked_at = $3 WHERE id = $1`, id, o.Uses,
			nullTime(o.RevokedAt))
		require.NoError(t, err)
	}
	out, err := store.GetJoinToken(ctx, db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return out
}

// EventOpts are the options of Event; zero fields get defaults.
type EventOpts struct {
	// TenantID is the event's tenant; with NoTenant, the event has none
	// (events.tenant_id NULL).
	TenantID string
	NoTenant bool
	// Type defaults to store.EventNodeCordoned, SubjectID to "node_x",
	// Data (a JSON object) to {}.
	Type, SubjectID, Data string
	// Age is how long ago the database inserted the event, by its own
	// clock (events.inserted_at); none by default.
	Age time.Duration
	// CreatedAt is the writer's time; it defaults to now, or to the insert
	// time of an event with an Age.
	CreatedAt time.Time
	// Tx, when set, is an open transaction of db to insert in: the event's
	// id is taken now, and the event is seen once Tx commits.
	Tx pgx.Tx
}

// Event inserts an events row of any type, tenant (or none) and data, with
// no hint published, and returns its id: for tests of the watch, which
// reads what the table holds. The control plane writes only the types of
// store.EventTypes, each with its data type, through store.WriteEvents.
func Event(t testing.TB, db *store.DB, opts *EventOpts) int64 {
	t.Helper()
	o := ptrOr(opts)
	var q store.DBTX = db.Pool
	if o.Tx != nil {
		q = o.Tx
	}
	var tenant *string
	if !o.NoTenant {
		tenant = &o.TenantID
	}
	created := nullTime(o.CreatedAt)
	if created == nil && o.Age == 0 {
		created = nullTime(db.Now())
	}
	var id int64
	require.NoError(t, q.QueryRow(t.Context(), `WITH c AS (SELECT clock_timestamp() - $6::bigint * interval '1 microsecond' AS at)
		INSERT INTO events (tenant_id, type, subject_id, data, created_at, inserted_at)
		SELECT $1, $2, $3, $4, COALESCE($5, c.at), c.at FROM c RETURNING id`, tenant, or(o.Type, store.EventNodeCordoned),
		or(o.SubjectID, "node_x"), or(o.Data, "{}"), created, o.Age.Microseconds()).Scan(&id))
	return id
}

// UsageWindowOpts are the options of UsageWindow; every field but
// CreatedAt is required.
type UsageWindowOpts struct {
	ReservationID, TenantID, PoolID string
	// WindowStart is the start of the hour.
	WindowStart time.Time
	GPUSeconds  int64
	CreatedAt   time.Time
}

// UsageWindow inserts a usage window of any GPU-seconds and returns it:
// for tests of the usage API. The controllers write windows from bookings
// (store.WriteUsageWindows).
func UsageWindow(t testing.TB, db *store.DB, opts *UsageWindowOpts) store.UsageWindow {
	t.Helper()
	_, err := db.Pool.Exec(t.Context(), `INSERT INTO usage_windows (reservation_id, window_start, tenant_id, pool_id, gpu_seconds,
			created_at)
		VALUES ($1, $2, $3, $4, $5, $6)`, opts.ReservationID, opts.WindowStart, opts.TenantID, opts.PoolID, opts.GPUSeconds,
		orNow(db, opts.CreatedAt))
	require.NoError(t, err)
	return store.UsageWindow{ReservationID: opts.ReservationID, TenantID: opts.TenantID, PoolID: opts.PoolID,
		WindowStart: opts.WindowStart, GPUSeconds: opts.GPUSeconds}
}

// hashOr returns hash, or the SHA-256 of s when hash is nil.
func hashOr(hash []byte, s string) []byte {
	if hash != nil {
		return hash
	}
	sum := sha256.Sum256([]byte(s))
	return sum[:]
}

// ptrOr returns *opts, or zero options when opts is nil.
func ptrOr[T any](opts *T) T {
	if opts == nil {
		var zero T
		return zero
	}
	return *opts
}

// TunnelTicketOpts are the options of TunnelTicket; NodeID and TokenID's
// tenant come from the caller, other zero fields get defaults.
type TunnelTicketOpts struct {
	// ID defaults to a new "tkt_…" id.
	ID string
	// NodeID and TokenID are required; TenantID defaults to the token's.
	NodeID, TokenID, TenantID string
	// Purpose defaults to "shell".
	Purpose       string
	ReservationID string
	// ExpiresAt defaults to a minute after CreatedAt.
	CreatedAt, ExpiresAt time.Time
}

// TunnelTicket inserts an unconsumed exec ticket (store.CreateTunnelTicket)
// and returns it.
func TunnelTicket(t testing.TB, db *store.DB, opts *TunnelTicketOpts) store.TunnelTicket {
	t.Helper()
	ctx := t.Context()
	at := orNow(db, opts.CreatedAt)
	tenant := opts.TenantID
	if tenant == "" {
		tok, err := store.GetAPIToken(ctx, db.Pool, store.AllTenants, opts.TokenID)
		require.NoError(t, err)
		tenant = tok.TenantID
	}
	tt := store.TunnelTicket{ID: or(opts.ID, ids.New(ids.Ticket, at)), NodeID: opts.NodeID, Purpose: or(opts.Purpose, "shell"),
		TenantID: tenant, TokenID: opts.TokenID, ReservationID: opts.ReservationID, CreatedAt: at,
		ExpiresAt: or(opts.ExpiresAt, at.Add(time.Minute))}
	require.NoError(t, store.CreateTunnelTicket(ctx, db.Pool, tt))
	out, err := store.GetTunnelTicket(ctx, db.Pool, tt.ID)
	require.NoError(t, err)
	return out
}

// OpenSession opens p's session as the gateway does (store.OpenSessions),
// in q (a transaction or the pool), presenting a certificate of the node
// that may open it: one recorded for the node, valid at p.Now and not
// revoked, else a new one (store.CreateNodeCert, a day from p.Now). It
// returns the node's state after the open, and store.ErrNotFound when the
// node does not exist.
func OpenSession(t testing.TB, q store.DBTX, p store.OpenSessionParams) (store.OpenedSession, error) {
	t.Helper()
	ctx := t.Context()
	var serial string
	err := q.QueryRow(ctx, `SELECT serial FROM node_certs WHERE node_id = $1 AND revoked_at IS NULL AND not_after > $2
		ORDER BY serial LIMIT 1`, p.NodeID, p.Now).Scan(&serial)
	if errors.Is(err, pgx.ErrNoRows) {
		var exists bool
		if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT FROM nodes WHERE id = $1)`, p.NodeID).Scan(&exists); err != nil {
			return store.OpenedSession{}, err
		}
		if !exists {
			return store.OpenedSession{}, store.ErrNotFound
		}
		serial = fmt.Sprintf("%x", 0xc0de0000+seq.Add(1))
		err = store.CreateNodeCert(ctx, q, store.NewNodeCert{Serial: serial, NodeID: p.NodeID, PublicKeySHA256: hashOr(nil, serial),
			NotBefore: p.Now, NotAfter: p.Now.Add(24 * time.Hour), CreatedAt: p.Now})
	}
	if err != nil {
		return store.OpenedSession{}, err
	}
	res, err := store.OpenSessions(ctx, q, []store.OpenSessionRequest{{Serial: serial, OpenSessionParams: p}})
	if err != nil {
		return store.OpenedSession{}, err
	}
	if !res[0].Opened {
		return store.OpenedSession{}, fmt.Errorf("storetest: the session of %s did not open (certificate %s: %+v)", p.NodeID, serial, res[0].Cert)
	}
	return res[0].Session, nil
}
