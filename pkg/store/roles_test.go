package store_test

import (
	"context"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// roleSources are, for each role, the Go packages whose store calls its
// service makes: the service's package, and the shared packages it runs
// (the API's authenticator and audit in pkg/iam; the leases of the
// scheduler and the controllers; the controllers' outbox relay). Paths are
// relative to pkg/store.
var roleSources = map[string][]string{
	store.RoleAPI:         {"../../services/api/api", "../iam"},
	store.RoleJoinService: {"../../services/joinservice/joinservice"},
	store.RoleGateway:     {"../../services/gateway/gateway"},
	store.RoleScheduler:   {"../../services/scheduler/scheduler", "../lease"},
	store.RoleControllers: {"../../services/controllers/controllers", "../lease", "../outbox"},
}

// rolePassword is the password the tests give role: the same in every test
// process, since roles are the cluster's.
func rolePassword(role string) string { return "test-" + role }

// asRole opens the database at dbURL as role.
func asRole(t *testing.T, dbURL, role string) *store.DB {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	u.User = url.UserPassword(role, rolePassword(role))
	db, err := store.Open(t.Context(), u.String(), clock.New(), 30*time.Second, store.Options{})
	require.NoError(t, err)
	t.Cleanup(db.Close)
	return db
}

// setupRoles returns a fresh database as its owner, its roles set up
// (SetupRoles with a login for each), and its URL.
func setupRoles(t *testing.T) (*store.DB, string) {
	t.Helper()
	dbURL := storetest.NewURL(t)
	owner, err := store.Open(t.Context(), dbURL, clock.New(), 30*time.Second, store.Options{})
	require.NoError(t, err)
	t.Cleanup(owner.Close)
	logins := map[string]string{}
	for _, r := range store.Roles() {
		logins[r] = rolePassword(r)
	}
	require.NoError(t, store.SetupRoles(t.Context(), owner, logins))
	return owner, dbURL
}

// dbFunctions returns the functions of package store that reach the
// database: those taking a DBTX, a *DB or a pgx.Tx.
func dbFunctions(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, f := range parseDir(t, ".") {
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Recv != nil || !fd.Name.IsExported() {
				continue
			}
			for _, p := range fd.Type.Params.List {
				switch typ := p.Type.(type) {
				case *ast.Ident:
					out[fd.Name.Name] = out[fd.Name.Name] || typ.Name == "DBTX"
				case *ast.StarExpr:
					if id, ok := typ.X.(*ast.Ident); ok && id.Name == "DB" {
						out[fd.Name.Name] = true
					}
				case *ast.SelectorExpr:
					if x, ok := typ.X.(*ast.Ident); ok && x.Name == "pgx" && typ.Sel.Name == "Tx" {
						out[fd.Name.Name] = true
					}
				}
			}
		}
	}
	return out
}

// parseDir parses the Go files of dir other than tests.
func parseDir(t *testing.T, dir string) []*ast.File {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var files []*ast.File
	fset := token.NewFileSet()
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		files = append(files, f)
	}
	require.NotEmpty(t, files, dir)
	return files
}

// serviceCalls returns, sorted, the store functions reaching the database
// that the packages of role (roleSources) name.
func serviceCalls(t *testing.T, role string, db map[string]bool) []string {
	t.Helper()
	set := map[string]bool{}
	for _, dir := range roleSources[role] {
		for _, f := range parseDir(t, dir) {
			ast.Inspect(f, func(n ast.Node) bool {
				if sel, ok := n.(*ast.SelectorExpr); ok {
					if x, ok := sel.X.(*ast.Ident); ok && x.Name == "store" && db[sel.Sel.Name] {
						set[sel.Sel.Name] = true
					}
				}
				return true
			})
		}
	}
	var out []string
	for name := range set {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// grantRun runs store functions as one role, each in a transaction of its
// own, and records their names.
type grantRun struct {
	t     *testing.T
	owner *store.DB // makes the fixtures
	as    *store.DB // connected as the role
	ran   map[string]bool
}

// call runs fn (store function name) in a transaction as the role; it fails
// the test on any error, a missing privilege (permission denied) first.
func (r *grantRun) call(name string, fn func(ctx context.Context, tx pgx.Tx) error) {
	r.t.Helper()
	r.ran[name] = true
	err := r.as.InTx(r.t.Context(), func(tx pgx.Tx) error { return fn(r.t.Context(), tx) })
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		r.t.Fatalf("%s as %s: a grant is missing in roles.sql: %v", name, r.as.Pool.Config().ConnConfig.User, err)
	}
	require.NoError(r.t, err, name)
}

// ranNames returns the names run, sorted.
func (r *grantRun) ranNames() []string {
	var out []string
	for name := range r.ran {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// TestRoleGrants runs, as each service's role, every store function that
// reaches the database and that the service's code names (found by parsing
// it: roleSources), on rows that make each take its writing path, with
// signed intent as compose runs it: a grant missing in roles.sql fails with
// permission denied. A store call added to a service fails the test until
// it is run here too.
func TestRoleGrants(t *testing.T) {
	t.Parallel()
	owner, dbURL := setupRoles(t)
	funcs := dbFunctions(t)
	require.True(t, funcs["OpenSessions"] && funcs["SetupRoles"] && !funcs["CommandMessage"], "dbFunctions finds what reaches the database")
	signer, _ := newIntentSigner(t)
	scenarios := map[string]func(r *grantRun){
		store.RoleAPI:         func(r *grantRun) { apiCalls(r, signer) },
		store.RoleJoinService: joinServiceCalls,
		store.RoleGateway:     gatewayCalls,
		store.RoleScheduler:   func(r *grantRun) { schedulerCalls(r, signer) },
		store.RoleControllers: func(r *grantRun) { controllersCalls(r, signer) },
	}
	require.Len(t, scenarios, len(store.Roles()))
	for _, role := range store.Roles() {
		t.Run(role, func(t *testing.T) {
			r := &grantRun{t: t, owner: owner, as: asRole(t, dbURL, role), ran: map[string]bool{}}
			scenarios[role](r)
			if diff := cmp.Diff(serviceCalls(t, role, funcs), r.ranNames()); diff != "" {
				t.Errorf("the store functions %s's service calls (-) and this test runs as it (+) differ:\n%s", role, diff)
			}
		})
	}
}

// TestRolesForbidWhatTheirServiceNeverDoes: the roles cannot write what
// their services never write (the gateway mints no API token, renames no
// tenant and records no node certificate, JoinService writes no command and
// lifts no node's revocation, the scheduler revokes no node's
// certificate), nor change the schema; SetupRoles run again keeps
// them so, and revokes a privilege granted by hand.
func TestRolesForbidWhatTheirServiceNeverDoes(t *testing.T) {
	t.Parallel()
	owner, dbURL := setupRoles(t)
	tenant := storetest.Tenant(t, owner, nil)
	node := storetest.Node(t, owner, nil)
	denied := func(t *testing.T, db *store.DB, sql string, args ...any) {
		t.Helper()
		_, err := db.Pool.Exec(t.Context(), sql, args...)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, sql)
		require.Equal(t, "42501", pgErr.Code, "%s: %v", sql, err) // insufficient_privilege
		require.Contains(t, pgErr.Message, "permission denied")
	}
	gw := asRole(t, dbURL, store.RoleGateway)
	denied(t, gw, `INSERT INTO api_tokens (id, tenant_id, hash, role, created_at) VALUES ('tok_x', $1, '\x00', 'root-admin', now())`, tenant.ID)
	denied(t, gw, `UPDATE tenants SET name = 'mine' WHERE id = $1`, tenant.ID)
	denied(t, gw, `DELETE FROM audit`)
	denied(t, gw, `CREATE TABLE gw_own (id int)`)
	denied(t, gw, `INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, created_at)
		VALUES ('0bad', $1, '\x00', now(), now() + interval '1 day', now())`, node.ID)
	denied(t, asRole(t, dbURL, store.RoleJoinService), `UPDATE nodes SET revoked_at = NULL WHERE id = $1`, node.ID)
	denied(t, asRole(t, dbURL, store.RoleJoinService), `INSERT INTO commands (id, node_id, kind, state, retry_safe, deadline, created_at, updated_at)
		VALUES ('cmd_x', $1, 'node.reboot', 'queued', false, now(), now(), now())`, node.ID)
	denied(t, asRole(t, dbURL, store.RoleScheduler), `UPDATE node_certs SET revoked_at = now()`)
	denied(t, asRole(t, dbURL, store.RoleAPI), `DELETE FROM nodes`)

	_, err := owner.Pool.Exec(t.Context(), `GRANT UPDATE ON tenants TO bc_gateway`)
	require.NoError(t, err)
	require.NoError(t, store.SetupRoles(t.Context(), owner, nil), "again, without logins: the passwords stay")
	denied(t, asRole(t, dbURL, store.RoleGateway), `UPDATE tenants SET name = 'mine' WHERE id = $1`, tenant.ID)

	require.ErrorContains(t, store.SetupRoles(t.Context(), owner, map[string]string{"bc": "x"}), `"bc" is not a service role`)
	require.ErrorContains(t, store.SetupRoles(t.Context(), owner, map[string]string{store.RoleAPI: ""}), "the password of bc_api is empty")
}

func apiCalls(r *grantRun, signer *store.IntentSigner) {
	t, o := r.t, r.owner
	now := o.Now()
	all := store.AllTenants
	f := storetest.NewFleetWith(t, o, storetest.FleetOpts{Name: "api", GPUs: []int{8, 8, 8},
		Node: func(i int, n *storetest.NodeOpts) { n.GatewayID = "gw-1" }})
	ten := store.Tenant{ID: ids.New(ids.Tenant, now), Name: "api-tenant", CreatedAt: now}
	site := store.Site{ID: ids.New(ids.Site, now), Name: "api-site", CreatedAt: now}
	pool := store.Pool{ID: ids.New(ids.Pool, now), SiteID: site.ID, OwnerTenantID: ten.ID, Name: "api-pool", Kind: "metal-host", CreatedAt: now}
	tok := store.APIToken{ID: ids.New(ids.APIToken, now), TenantID: ten.ID, Name: "t", Hash: []byte("api-token-hash"),
		Role: "tenant-admin", CreatedAt: now}
	join := store.JoinToken{ID: ids.New(ids.JoinToken, now), PoolID: pool.ID, Hash: []byte("api-join-hash"), MaxUses: 1,
		ExpiresAt: now.Add(time.Hour), CreatedAt: now}
	r.call("CreateTenant", func(ctx context.Context, tx pgx.Tx) error { return store.CreateTenant(ctx, tx, ten) })
	r.call("GetTenant", func(ctx context.Context, tx pgx.Tx) error { _, err := store.GetTenant(ctx, tx, ten.ID); return err })
	r.call("ListTenants", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListTenants(ctx, tx, store.TenantFilter{Scope: all})
		return err
	})
	r.call("CreateSite", func(ctx context.Context, tx pgx.Tx) error { return store.CreateSite(ctx, tx, site) })
	r.call("GetSite", func(ctx context.Context, tx pgx.Tx) error { _, err := store.GetSite(ctx, tx, site.ID); return err })
	r.call("ListSites", func(ctx context.Context, tx pgx.Tx) error { _, err := store.ListSites(ctx, tx); return err })
	r.call("CreatePool", func(ctx context.Context, tx pgx.Tx) error { return store.CreatePool(ctx, tx, pool) })
	r.call("GetPool", func(ctx context.Context, tx pgx.Tx) error { _, err := store.GetPool(ctx, tx, all, pool.ID); return err })
	r.call("ListPools", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListPools(ctx, tx, store.PoolFilter{Scope: all})
		return err
	})
	for range 2 { // the second is the upsert's update
		r.call("UpsertOffer", func(ctx context.Context, tx pgx.Tx) error {
			_, err := store.UpsertOffer(ctx, tx, all, store.Offer{PoolID: f.PoolID, TenantID: ten.ID, GPUQuota: 16, CreatedAt: now, UpdatedAt: now})
			return err
		})
	}
	r.call("ListOffers", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListOffers(ctx, tx, store.OfferFilter{Scope: all})
		return err
	})
	r.call("CreateJoinToken", func(ctx context.Context, tx pgx.Tx) error { return store.CreateJoinToken(ctx, tx, all, join) })
	r.call("ListJoinTokens", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListJoinTokens(ctx, tx, store.JoinTokenFilter{Scope: all})
		return err
	})
	r.call("RevokeJoinToken", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.RevokeJoinToken(ctx, tx, all, join.ID, now)
		return err
	})
	r.call("CreateAPIToken", func(ctx context.Context, tx pgx.Tx) error { return store.CreateAPIToken(ctx, tx, tok) })
	r.call("GetAPIToken", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetAPIToken(ctx, tx, all, tok.ID)
		return err
	})
	r.call("GetAPITokenByHash", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetAPITokenByHash(ctx, tx, tok.Hash)
		return err
	})
	r.call("ListAPITokens", func(ctx context.Context, tx pgx.Tx) error { _, err := store.ListAPITokens(ctx, tx, all); return err })
	r.call("TouchAPIToken", func(ctx context.Context, tx pgx.Tx) error { return store.TouchAPIToken(ctx, tx, tok.ID, now) })
	r.call("CountLiveRootAdminTokens", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CountLiveRootAdminTokens(ctx, tx, now, "")
		return err
	})
	r.call("InsertAudit", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.InsertAudit(ctx, tx, store.AuditEntry{At: now, TenantID: ten.ID, Procedure: "/test", Outcome: "ok"})
		return err
	})
	r.call("ListAudit", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListAudit(ctx, tx, store.AuditFilter{Scope: all, Limit: 10})
		return err
	})

	n0, n1, n2 := f.Nodes[0], f.Nodes[1], f.Nodes[2]
	r.call("GetNode", func(ctx context.Context, tx pgx.Tx) error { _, err := store.GetNode(ctx, tx, all, n0); return err })
	r.call("ListNodes", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListNodes(ctx, tx, store.NodeFilter{Scope: all})
		return err
	})
	r.call("CordonNode", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CordonNode(ctx, tx, all, now, n0, "test")
		return err
	})
	r.call("UncordonNode", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.UncordonNode(ctx, tx, all, now, n0)
		return err
	})
	cmdID := ids.New(ids.Command, now)
	r.call("QueueCommands", func(ctx context.Context, tx pgx.Tx) error {
		res, err := store.QueueCommands(ctx, tx, signer, now, []store.NewCommand{{ID: cmdID, NodeID: n0, Kind: store.CommandDiagNVML,
			Deadline: now.Add(time.Hour), RequestID: "req-1", Scope: all,
			Audit: &store.AuditEntry{TenantID: ten.ID, Procedure: "/run", Outcome: "ok"}}})
		if err == nil && res[0].Err != nil {
			err = res[0].Err
		}
		return err
	})
	r.call("GetCommand", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetCommand(ctx, tx, all, cmdID)
		return err
	})
	r.call("ListCommands", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListCommands(ctx, tx, store.CommandFilter{Scope: all, NodeID: n0})
		return err
	})

	resID := ids.New(ids.Reservation, now)
	r.call("CreateReservation", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CreateReservation(ctx, tx, now, store.NewReservation{ID: resID, TenantID: ten.ID, PoolID: f.PoolID, GPUs: 1,
			StartAt: now, EndAt: now.Add(time.Hour)})
		return err
	})
	r.call("GetReservation", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetReservation(ctx, tx, all, resID)
		return err
	})
	r.call("ListReservations", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListReservations(ctx, tx, store.ReservationFilter{Scope: all})
		return err
	})
	active := func(node string) store.Reservation {
		return storetest.Reservation(t, o, &storetest.ReservationOpts{TenantID: ten.ID, PoolID: f.PoolID, State: store.ReservationActive,
			NodeID: node, DeviceIndexes: []int32{0}, SpecGeneration: 1, PlacedAt: now, ActiveAt: now})
	}
	ended := active(n1)
	r.call("EndReservation", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, signer, all, now, ended.ID, store.ReservationReleased)
		return err
	})
	active(n2)
	r.call("FailNodeReservations", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.FailNodeReservations(ctx, tx, signer, now, n2, "test")
		return err
	})
	storetest.NodeCert(t, o, &storetest.NodeCertOpts{NodeID: n2})
	storetest.Command(t, o, &storetest.CommandOpts{NodeID: n2})
	r.call("RevokeNode", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.RevokeNode(ctx, tx, all, now, n2, "test")
		return err
	})
	storetest.UsageWindow(t, o, &storetest.UsageWindowOpts{ReservationID: ended.ID, TenantID: ten.ID, PoolID: f.PoolID,
		WindowStart: now.Truncate(time.Hour), GPUSeconds: 60})
	r.call("ListUsage", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ListUsage(ctx, tx, store.UsageFilter{Scope: all, Limit: 10})
		return err
	})
	r.call("OpenUsage", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.OpenUsage(ctx, tx, store.UsageFilter{Scope: all, Limit: 10}, now)
		return err
	})
	r.call("ScanEvents", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ScanEvents(ctx, tx, 0, store.EventFilter{Scope: all}, 100)
		return err
	})
	r.call("MaxEventID", func(ctx context.Context, tx pgx.Tx) error { _, err := store.MaxEventID(ctx, tx, all); return err })
	r.call("EventRetention", func(ctx context.Context, tx pgx.Tx) error {
		_, _, err := store.EventRetention(ctx, tx, all)
		return err
	})
	r.call("EventWriters", func(ctx context.Context, tx pgx.Tx) error {
		var xid int64
		if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&xid); err != nil {
			return err
		}
		_, _, err := store.EventWriters(ctx, tx, []int64{xid})
		return err
	})
	r.call("ScanWriters", func(ctx context.Context, tx pgx.Tx) error {
		scan, err := store.ScanEvents(ctx, tx, 0, store.EventFilter{Scope: all}, 100)
		if err != nil {
			return err
		}
		_, _, _, err = store.ScanWriters(ctx, tx, scan)
		return err
	})

	require.NoError(t, store.RegisterGateway(t.Context(), o.Pool, "gw-1", "http://gw-1:8086", now))
	require.NoError(t, store.RecordGatewayPresence(t.Context(), o.Pool, now, "gw-1", time.Minute))
	r.call("NodeTunnelRoute", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.NodeTunnelRoute(ctx, tx, n0, now)
		return err
	})
	ticket := store.TunnelTicket{ID: ids.New(ids.Ticket, now), NodeID: n0, Purpose: "shell", TenantID: ten.ID, TokenID: tok.ID,
		CreatedAt: now, ExpiresAt: now.Add(time.Minute)}
	r.call("CreateTunnelTicket", func(ctx context.Context, tx pgx.Tx) error { return store.CreateTunnelTicket(ctx, tx, ticket) })
	r.call("ConsumeTunnelTicket", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ConsumeTunnelTicket(ctx, tx, ticket.ID, now, store.TunnelLimits{PerNode: 4, PerToken: 4})
		return err
	})
	r.call("TouchTunnel", func(ctx context.Context, tx pgx.Tx) error { return store.TouchTunnel(ctx, tx, ticket.ID, now) })
	r.call("CloseTunnel", func(ctx context.Context, tx pgx.Tx) error { return store.CloseTunnel(ctx, tx, ticket.ID, now, "done") })
	r.call("RevokeAPIToken", func(ctx context.Context, tx pgx.Tx) error { return store.RevokeAPIToken(ctx, tx, all, tok.ID, now) })
}

func joinServiceCalls(r *grantRun) {
	t, o := r.t, r.owner
	now := o.Now()
	tok := storetest.JoinToken(t, o, &storetest.JoinTokenOpts{MaxUses: 5})
	r.call("CheckJoinToken", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CheckJoinToken(ctx, tx, tok.Hash, now)
		return err
	})
	key := []byte("join-key-sha256-of-the-test-node")
	node := ids.New(ids.Node, now)
	r.call("RecordJoins", func(ctx context.Context, tx pgx.Tx) error {
		out, err := store.RecordJoins(ctx, tx, now, []store.Join{{TokenHash: tok.Hash, Node: store.NewNode{ID: node},
			Cert: store.NewNodeCert{Serial: "0a01", PublicKeySHA256: key, NotBefore: now, NotAfter: now.Add(time.Hour)}}})
		if err == nil {
			err = out[0].Err
		}
		return err
	})
	r.call("CreateNodeCert", func(ctx context.Context, tx pgx.Tx) error {
		return store.CreateNodeCert(ctx, tx, store.NewNodeCert{Serial: "0a02", NodeID: node, PublicKeySHA256: key, NotBefore: now,
			NotAfter: now.Add(time.Hour), CreatedAt: now})
	})
	// A renewal (NodeCertService): the session's certificates, the node
	// locked through its client certificate, its newest certificate.
	r.call("LockSessionCert", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.LockSessionCert(ctx, tx, "0a01")
		return err
	})
	r.call("GetSessionCert", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetSessionCert(ctx, tx, "0a02")
		return err
	})
	r.call("LastNodeCertCreatedAt", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.LastNodeCertCreatedAt(ctx, tx, node)
		return err
	})
	r.call("GetNode", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetNode(ctx, tx, store.AllTenants, node)
		return err
	})
}

func gatewayCalls(r *grantRun) {
	t, o := r.t, r.owner
	now := o.Now()
	const gw = "gw-test"
	// Node 0 is unreachable: its session and heartbeat make it reachable
	// (an event).
	f := storetest.NewFleetWith(t, o, storetest.FleetOpts{Name: "gw", GPUs: []int{8, 8},
		Node: func(i int, n *storetest.NodeOpts) {
			n.GatewayID, n.Reachable = gw, i != 0
			n.LastSeen = now.Add(-time.Minute)
		}})
	n0, n1 := f.Nodes[0], f.Nodes[1]
	cert := storetest.NodeCert(t, o, &storetest.NodeCertOpts{NodeID: n0})
	cmd := storetest.Command(t, o, &storetest.CommandOpts{NodeID: n0})
	tenant := f.Tenant(t, "gw-tenant", 8)
	binding := storetest.Reservation(t, o, &storetest.ReservationOpts{TenantID: tenant, PoolID: f.PoolID, State: store.ReservationBinding,
		NodeID: n1, DeviceIndexes: []int32{0}, SpecGeneration: 1, PlacedAt: now})

	r.call("RegisterGateway", func(ctx context.Context, tx pgx.Tx) error {
		return store.RegisterGateway(ctx, tx, gw, "http://gw-test:8086", now)
	})
	r.call("RecordGatewayPresence", func(ctx context.Context, tx pgx.Tx) error {
		return store.RecordGatewayPresence(ctx, tx, now, gw, 15*time.Second)
	})
	r.call("ResetGatewaySessions", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ResetGatewaySessions(ctx, tx, now, gw)
		return err
	})
	r.call("GetSessionCert", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.GetSessionCert(ctx, tx, cert.Serial)
		return err
	})
	sid := ids.New(ids.Session, now)
	r.call("OpenSessions", func(ctx context.Context, tx pgx.Tx) error {
		res, err := store.OpenSessions(ctx, tx, []store.OpenSessionRequest{{Serial: cert.Serial, OpenSessionParams: store.OpenSessionParams{
			NodeID: n0, GatewayID: gw, SessionID: sid, BootID: "boot", AgentVersion: "test", Now: now}}})
		if err == nil && !res[0].Opened {
			return errors.New("the session was not opened")
		}
		return err
	})
	r.call("PendingSessionWork", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.PendingSessionWork(ctx, tx, []store.SessionRef{{NodeID: n0, SessionID: sid, Serial: cert.Serial}})
		return err
	})
	r.call("ClaimSessionDeliveries", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ClaimSessionDeliveries(ctx, tx, now, []store.ClaimRequest{{NodeID: n0, SessionID: sid}})
		return err
	})
	r.call("ApplySessionCommandUpdates", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ApplySessionCommandUpdates(ctx, tx, []store.SessionCommandUpdate{{NodeID: n0, CommandID: cmd.ID,
			State: "succeeded", Result: []byte(`{}`), Now: now}})
		return err
	})
	r.call("RecordSessionLastSeen", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.RecordSessionLastSeen(ctx, tx, []store.SessionLastSeen{{NodeID: n0, SessionID: sid, At: now, ObservedGeneration: 1}})
		return err
	})
	r.call("RecordSessionObservedGenerations", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.RecordSessionObservedGenerations(ctx, tx, now, []store.ObservedGeneration{{NodeID: n1, Generation: 1}})
		return err
	})
	r.call("ActivateReservations", func(ctx context.Context, tx pgx.Tx) error {
		a, err := store.ActivateReservations(ctx, tx, now, []store.AllocationBound{{NodeID: n1, ReservationID: binding.ID,
			Binding: []string{"nvidia.com/gpu=0"}, Generation: 1}})
		if err == nil && !a[0].Activated {
			err = errors.New("not activated")
		}
		return err
	})
	r.call("RecordSpecRefused", func(ctx context.Context, tx pgx.Tx) error {
		return store.RecordSpecRefused(ctx, tx, now, n0, 1, "unsigned")
	})
	r.call("RecordSSHRefused", func(ctx context.Context, tx pgx.Tx) error {
		return store.RecordSSHRefused(ctx, tx, now, store.SSHRefusal{NodeID: n0, Reason: "unknown CA", KeyID: "k", User: "root"})
	})
	r.call("CloseSession", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CloseSession(ctx, tx, now, n0, sid, now)
		return err
	})
}

func schedulerCalls(r *grantRun, signer *store.IntentSigner) {
	t, o := r.t, r.owner
	ctx := t.Context()
	f := storetest.NewFleet(t, o, "sched", 8, 8)
	tenant := f.Tenant(t, "sched-tenant", 16)
	placed, err := f.Reserve(ctx, tenant, 2, time.Hour)
	require.NoError(t, err)
	failed, err := f.Reserve(ctx, tenant, 1, time.Hour)
	require.NoError(t, err)
	now := o.Now()
	r.call("TryAcquireLease", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.TryAcquireLease(ctx, tx, "scheduler", "test", now, 15*time.Second)
		return err
	})
	r.call("PendingReservations", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.PendingReservations(ctx, tx, now, 10)
		return err
	})
	r.call("PoolCapacitySince", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.PoolCapacitySince(ctx, tx, f.PoolID, now, map[string]int64{f.Nodes[0]: 0})
		return err
	})
	r.call("SetPendingReasons", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.SetPendingReasons(ctx, tx, now, []store.PendingReason{{ID: placed.ID, Reason: "waiting"}})
		return err
	})
	r.call("PlaceReservationsAt", func(ctx context.Context, tx pgx.Tx) error {
		got, err := store.PoolCapacitySince(ctx, tx, f.PoolID, now, nil)
		if err != nil {
			return err
		}
		gens := map[string]int64{}
		for _, c := range got {
			gens[c.ID] = c.Generation
		}
		done, err := store.PlaceReservationsAt(ctx, tx, signer, now, []store.Placement{{ReservationID: placed.ID, TenantID: tenant,
			NodeID: f.Nodes[0], Devices: []int32{0, 1}, Lower: now, Upper: placed.EndAt}}, gens)
		if err == nil && len(done.Placed) != 1 {
			err = errors.New("not placed")
		}
		return err
	})
	r.call("FailReservations", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.FailReservations(ctx, tx, now, []store.ReservationFailure{{ID: failed.ID, TenantID: tenant, Reason: "test"}})
		return err
	})
	r.call("ReleaseLease", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ReleaseLease(ctx, tx, "scheduler", "test")
		return err
	})
}

func controllersCalls(r *grantRun, signer *store.IntentSigner) {
	t, o := r.t, r.owner
	now := o.Now()
	// Nodes 0 and 1 are adopted and reachable with a session on a gateway
	// that has no presence (the sweeper marks them unreachable); 2 and 3
	// are joining, then accepting; 4 joined hours ago with a token and
	// never came.
	f := storetest.NewFleetWith(t, o, storetest.FleetOpts{Name: "ctl", GPUs: []int{8, 8, 0, 0, 0},
		Node: func(i int, n *storetest.NodeOpts) {
			n.GatewayID, n.LastSeen = "gw-gone", now.Add(-time.Hour)
			if i >= 2 {
				n.State, n.Reachable, n.SessionID, n.GatewayID, n.LastSeen, n.SpecGeneration = store.NodeJoining, false, "", "", time.Time{}, 0
			}
		}})
	n0, n1, accepting := f.Nodes[0], f.Nodes[1], f.Nodes[2:4]
	tok := storetest.JoinToken(t, o, &storetest.JoinTokenOpts{PoolID: f.PoolID, MaxUses: 2, Uses: 1})
	stale := storetest.Node(t, o, &storetest.NodeOpts{PoolID: f.PoolID, JoinTokenID: tok.ID, CreatedAt: now.Add(-3 * time.Hour)})
	storetest.NodeCert(t, o, &storetest.NodeCertOpts{NodeID: stale.ID})
	tenant := f.Tenant(t, "ctl-tenant", 16)
	due := storetest.Reservation(t, o, &storetest.ReservationOpts{TenantID: tenant, PoolID: f.PoolID, State: store.ReservationActive,
		NodeID: n0, DeviceIndexes: []int32{0}, SpecGeneration: 1, StartAt: now.Add(-2 * time.Hour), EndAt: now.Add(-time.Minute),
		PlacedAt: now.Add(-2 * time.Hour), ActiveAt: now.Add(-2 * time.Hour)})
	neverPlaced := storetest.Reservation(t, o, &storetest.ReservationOpts{TenantID: tenant, PoolID: f.PoolID,
		StartAt: now.Add(-2 * time.Hour), EndAt: now.Add(-time.Minute)})
	late := storetest.Command(t, o, &storetest.CommandOpts{NodeID: n1, Deadline: now.Add(-time.Minute), CreatedAt: now.Add(-time.Hour)})
	other := storetest.Command(t, o, &storetest.CommandOpts{NodeID: n1, State: "delivered"})

	r.call("TryAcquireLease", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.TryAcquireLease(ctx, tx, "controllers.test", "test", now, 15*time.Second)
		return err
	})
	r.call("FleetStatsAt", func(ctx context.Context, tx pgx.Tx) error { _, err := store.FleetStatsAt(ctx, tx, now); return err })
	r.call("AnyAcceptanceWork", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.AnyAcceptanceWork(ctx, tx, now)
		return err
	})
	r.call("ClaimJoiningNodes", func(ctx context.Context, tx pgx.Tx) error { _, err := store.ClaimJoiningNodes(ctx, tx, 10); return err })
	r.call("StartAcceptance", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.StartAcceptance(ctx, tx, signer, now, now.Add(-time.Second), []store.NewAcceptanceCommand{
			{ID: ids.New(ids.Command, now), NodeID: accepting[0]}, {ID: ids.New(ids.Command, now), NodeID: accepting[1]}})
		return err
	})
	r.call("MarkNodesAccepting", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.MarkNodesAccepting(ctx, tx, now, accepting)
		return err
	})
	r.call("QueueAcceptanceCommands", func(ctx context.Context, tx pgx.Tx) error {
		return store.QueueAcceptanceCommands(ctx, tx, signer, now, now.Add(-time.Second), []store.NewAcceptanceCommand{
			{ID: ids.New(ids.Command, now), NodeID: accepting[0]}, {ID: ids.New(ids.Command, now), NodeID: accepting[1]}})
	})
	r.call("ClaimDueAcceptances", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ClaimDueAcceptances(ctx, tx, now, 10)
		return err
	})
	r.call("AcceptanceChecks", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.AcceptanceChecks(ctx, tx, accepting)
		return err
	})
	devices := []store.NodeDevice{{Index: 0, UUID: "GPU-ctl-0", Model: storetest.DefaultGPUModel, Healthy: true}}
	r.call("AdoptNodes", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.AdoptNodes(ctx, tx, signer, now, []store.Adoption{{NodeID: accepting[0], PoolID: f.PoolID, OwnerTenantID: f.OwnerID,
			Spec: []byte(`{}`), Inventory: []byte(`{}`), Devices: devices}})
		return err
	})
	r.call("FailAcceptance", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.FailAcceptance(ctx, tx, now, []store.AcceptanceFailure{{NodeID: accepting[1], PoolID: f.PoolID,
			OwnerTenantID: f.OwnerID, Reason: "test", Inventory: []byte(`{}`), Devices: devices}})
		return err
	})
	r.call("ExpireJoiningNodes", func(ctx context.Context, tx pgx.Tx) error {
		gone, err := store.ExpireJoiningNodes(ctx, tx, now, time.Hour, 10)
		if err == nil && len(gone) == 0 {
			err = errors.New("expired none")
		}
		return err
	})
	r.call("ClaimDueReservations", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ClaimDueReservations(ctx, tx, now, 10)
		return err
	})
	r.call("FailNeverPlaced", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.FailNeverPlaced(ctx, tx, now, []string{neverPlaced.ID})
		return err
	})
	r.call("EndReservation", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, signer, store.AllTenants, now, due.ID, store.ReservationExpired)
		return err
	})
	var candidates []string
	r.call("UsageCandidates", func(ctx context.Context, tx pgx.Tx) error {
		var err error
		candidates, err = store.UsageCandidates(ctx, tx, "", 10)
		return err
	})
	r.call("WriteUsageWindows", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.WriteUsageWindows(ctx, tx, now, candidates)
		return err
	})
	r.call("ExpireDueCommands", func(ctx context.Context, tx pgx.Tx) error {
		cs, err := store.ExpireDueCommands(ctx, tx, now, 10)
		if err == nil && (len(cs) != 1 || cs[0].ID != late.ID) {
			err = errors.New("the late command is not expired")
		}
		return err
	})
	r.call("ExpireCommands", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ExpireCommands(ctx, tx, now, []string{other.ID}, store.ExpiryReasons{Queued: "q", Delivered: "d", Running: "r"})
		return err
	})
	r.call("SweepUnreachable", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.SweepUnreachable(ctx, tx, now, 30*time.Second, 10)
		return err
	})
	r.call("PokeNodes", func(ctx context.Context, tx pgx.Tx) error { return store.PokeNodes(ctx, tx, now, n0, n1) })
	r.call("SetSSHUserCAs", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.SetSSHUserCAs(ctx, tx, signer, now, []*gatewayv1.SshUserCa{{Name: "break-glass", PublicKey: "ssh-ed25519 AAAAbg"},
			{Name: "sandbox", PublicKey: "ssh-ed25519 AAAAsb"}})
		return err
	})
	r.call("TakeOutbox", func(ctx context.Context, tx pgx.Tx) error {
		msgs, err := store.TakeOutbox(ctx, tx, 0, 100)
		if err == nil && len(msgs) == 0 {
			err = errors.New("took nothing")
		}
		return err
	})
	r.call("DeadLetterOutbox", func(ctx context.Context, tx pgx.Tx) error {
		return store.DeadLetterOutbox(ctx, tx, now, store.OutboxMessage{ID: 1, Subject: "bc.test", Payload: []byte("x"),
			CreatedAt: now}, "a test")
	})
	// Retention, with every row due: each deletes something (an older
	// certificate of n0, not its newest).
	_, err := store.InsertAudit(t.Context(), o.Pool, store.AuditEntry{At: now, TenantID: tenant, Procedure: "/test", Outcome: "ok"})
	require.NoError(t, err)
	storetest.NodeCert(t, o, &storetest.NodeCertOpts{NodeID: n0, NotAfter: now.Add(time.Hour)})
	storetest.NodeCert(t, o, &storetest.NodeCertOpts{NodeID: n0, NotAfter: now.Add(2 * time.Hour)})
	storetest.UsageWindow(t, o, &storetest.UsageWindowOpts{ReservationID: due.ID, TenantID: tenant, PoolID: f.PoolID,
		WindowStart: now.Add(-1000 * time.Hour).Truncate(time.Hour), GPUSeconds: 1})
	later := now.Add(1000 * 24 * time.Hour)
	for name, del := range map[string]func(context.Context, store.DBTX, time.Time, int) (int, error){
		"DeleteOldEvents": store.DeleteOldEvents, "DeleteOldAudit": store.DeleteOldAudit,
		"DeleteOldCommands": store.DeleteOldCommands, "DeleteOldReservations": store.DeleteOldReservations,
		"DeleteOldUsageWindows": store.DeleteOldUsageWindows, "DeleteOldNodeCerts": store.DeleteOldNodeCerts,
		"DeleteOldJoinTokens": store.DeleteOldJoinTokens,
	} {
		r.call(name, func(ctx context.Context, tx pgx.Tx) error {
			n, err := del(ctx, tx, later, 100)
			if err == nil && n == 0 {
				err = errors.New("deleted none")
			}
			return err
		})
	}
	r.call("ReleaseLease", func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.ReleaseLease(ctx, tx, "controllers.test", "test")
		return err
	})
}

// TestSetupRolesInTwoDatabasesAtOnce: roles are the cluster's, so two
// databases setting them up at once update the same pg_authid rows, which
// PostgreSQL refuses to one of them ("tuple concurrently updated"); both
// succeed.
func TestSetupRolesInTwoDatabasesAtOnce(t *testing.T) {
	t.Parallel()
	logins := map[string]string{}
	for _, r := range store.Roles() {
		logins[r] = rolePassword(r)
	}
	var dbs []*store.DB
	for range 2 {
		db, err := store.Open(t.Context(), storetest.NewURL(t), clock.New(), 30*time.Second, store.Options{})
		require.NoError(t, err)
		t.Cleanup(db.Close)
		dbs = append(dbs, db)
	}
	for range 5 {
		errs := make(chan error, len(dbs))
		for _, db := range dbs {
			go func() { errs <- store.SetupRoles(t.Context(), db, logins) }()
		}
		for range dbs {
			require.NoError(t, <-errs)
		}
	}
}
