package store

// Tenant scopes: which tenants' rows a read or a write of tenant-owned rows
// may touch.

// Scope is the set of tenants whose rows a read or a write may touch: one
// tenant's, or every tenant's. Every function of this package that reads or
// changes rows a tenant owns (pools and their offers, nodes, join tokens,
// commands, reservations, usage, API tokens, audit rows, events, tenants)
// takes one, so that the tenant rule is applied in the query itself and a
// caller cannot forget it: a row outside the scope is ErrNotFound to a get
// or a change, and absent from a list, exactly as a missing row is.
//
// The API derives its callers' scopes in one place, iam.Principal.Scope; the
// control plane's own work (reconcilers, the scheduler, the gateway) uses
// AllTenants. The zero Scope includes no tenant: a filter whose Scope was
// left unset matches nothing rather than everything.
type Scope struct {
	tenantID string
	all      bool
}

// AllTenants is the scope of every tenant's rows: a root administrator's,
// and the control plane's own.
var AllTenants = Scope{all: true}

// TenantScope returns the scope of the rows of tenant tenantID alone; an
// empty tenantID gives the zero Scope, which includes no tenant.
func TenantScope(tenantID string) Scope { return Scope{tenantID: tenantID} }

// Includes reports whether rows of tenantID are in s.
func (s Scope) Includes(tenantID string) bool {
	return s.all || (s.tenantID != "" && s.tenantID == tenantID)
}

// All reports whether s is AllTenants.
func (s Scope) All() bool { return s.all }

// Tenant returns the one tenant of s; "" for AllTenants and for the zero
// Scope.
func (s Scope) Tenant() string {
	if s.all {
		return ""
	}
	return s.tenantID
}

// Narrow returns the scope of tenantID's rows alone when s includes
// tenantID, for a call that names one tenant (ListTokens' tenant_id):
// false when s does not include it.
func (s Scope) Narrow(tenantID string) (Scope, bool) {
	if !s.Includes(tenantID) {
		return Scope{}, false
	}
	return TenantScope(tenantID), true
}

// String is "all tenants", "tenant <id>" or "no tenant", for logs and
// errors.
func (s Scope) String() string {
	switch {
	case s.all:
		return "all tenants"
	case s.tenantID == "":
		return "no tenant"
	default:
		return "tenant " + s.tenantID
	}
}

// arg is s as a query parameter for a condition written
// `($n::text IS NULL OR <tenant column> = $n)`: NULL for AllTenants, the
// tenant's id otherwise ("" for the zero Scope, which no row's tenant
// equals).
func (s Scope) arg() *string {
	if s.all {
		return nil
	}
	id := s.tenantID
	return &id
}
