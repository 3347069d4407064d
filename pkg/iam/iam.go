// Package iam authenticates API callers and decides what they may do.
//
// Callers present an API token ("bct_" + 32 random bytes in base64url) as
// `Authorization: Bearer <token>`. Only the token's SHA-256 is stored
// (api_tokens.hash), with its tenant, one Role, an optional expiry and a
// revocation time. A Role grants Permissions; a Principal holds the caller's
// tenant and role, and may touch a tenant's resources when it belongs to that
// tenant or is a root administrator.
//
// To extend it: add a Permission constant and grant it to roles in
// rolePermissions; then name it in the per-RPC table of the service that
// needs it (services/api/api/authz.go).
package iam

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

// Role is what an API token may do, within its tenant or, for RoleRootAdmin,
// everywhere.
type Role string

// The roles, as stored in api_tokens.role.
const (
	// RoleRootAdmin may do everything in every tenant.
	RoleRootAdmin Role = "root-admin"
	// RoleTenantAdmin manages its tenant's fleet: sites, pools, join tokens.
	RoleTenantAdmin Role = "tenant-admin"
	// RoleTenantMember uses its tenant's fleet.
	RoleTenantMember Role = "tenant-member"
	// RoleViewer only reads its tenant's fleet.
	RoleViewer Role = "viewer"
)

// Roles lists every role, most powerful first.
func Roles() []Role { return []Role{RoleRootAdmin, RoleTenantAdmin, RoleTenantMember, RoleViewer} }

// ParseRole returns the role named s, or an error listing the roles.
func ParseRole(s string) (Role, error) {
	for _, r := range Roles() {
		if string(r) == s {
			return r, nil
		}
	}
	return "", fmt.Errorf("unknown role %q (want root-admin, tenant-admin, tenant-member or viewer)", s)
}

// Permission is one kind of action a role may be granted.
type Permission string

// The permissions.
const (
	// PermFleetRead reads sites, pools and nodes.
	PermFleetRead Permission = "fleet.read"
	// PermFleetManage creates sites and pools and mints, lists and revokes
	// join tokens.
	PermFleetManage Permission = "fleet.manage"
)

var rolePermissions = map[Role][]Permission{
	RoleRootAdmin:    {PermFleetRead, PermFleetManage},
	RoleTenantAdmin:  {PermFleetRead, PermFleetManage},
	RoleTenantMember: {PermFleetRead},
	RoleViewer:       {PermFleetRead},
}

// Grants reports whether role r has permission p.
func (r Role) Grants(p Permission) bool {
	for _, q := range rolePermissions[r] {
		if q == p {
			return true
		}
	}
	return false
}

// Principal is an authenticated caller.
type Principal struct {
	// TokenID is the API token's id ("tok_…").
	TokenID string
	// TenantID is the tenant the token belongs to.
	TenantID string
	Role     Role
}

// IsRoot reports whether p is a root administrator.
func (p Principal) IsRoot() bool { return p.Role == RoleRootAdmin }

// Can reports whether p holds permission perm.
func (p Principal) Can(perm Permission) bool { return p.Role.Grants(perm) }

// InTenant reports whether p may touch resources owned by tenantID: its own
// tenant's, or any tenant's for a root administrator.
func (p Principal) InTenant(tenantID string) bool { return p.IsRoot() || p.TenantID == tenantID }

// TenantScope returns the tenant whose resources p sees, or "" (all tenants)
// for a root administrator; use it as a store filter.
func (p Principal) TenantScope() string {
	if p.IsRoot() {
		return ""
	}
	return p.TenantID
}

type principalKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// PrincipalFrom returns the principal in ctx and whether there is one.
func PrincipalFrom(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(Principal)
	return p, ok
}

// Prefixes of secrets.
const (
	// APITokenPrefix starts every API token.
	APITokenPrefix = "bct_"
	// JoinTokenPrefix starts every join token.
	JoinTokenPrefix = "bcjt_"
)

// NewSecret returns prefix followed by 32 random bytes in unpadded base64url.
func NewSecret(prefix string) (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("read random bytes: %w", err)
	}
	return prefix + base64.RawURLEncoding.EncodeToString(b), nil
}

// HashSecret returns the SHA-256 of a secret, the form in which API and join
// tokens are stored and looked up.
func HashSecret(secret string) []byte {
	sum := sha256.Sum256([]byte(secret))
	return sum[:]
}

// MintAPIToken creates an API token of tenantID with role, valid until
// expiresAt (nil for ever), and returns its secret (shown once) and row.
func MintAPIToken(ctx context.Context, q store.DBTX, now time.Time, tenantID, name string, role Role, expiresAt *time.Time) (string, store.APIToken, error) {
	if _, err := ParseRole(string(role)); err != nil {
		return "", store.APIToken{}, err
	}
	secret, err := NewSecret(APITokenPrefix)
	if err != nil {
		return "", store.APIToken{}, err
	}
	tok := store.APIToken{ID: ids.New(ids.APIToken, now), TenantID: tenantID, Name: name, Hash: HashSecret(secret),
		Role: string(role), ExpiresAt: expiresAt, CreatedAt: now}
	if err := store.CreateAPIToken(ctx, q, tok); err != nil {
		return "", store.APIToken{}, err
	}
	return secret, tok, nil
}

// ErrUnauthenticated is matched (errors.Is) by every refusal of
// Authenticate; the error's text says what was wrong with the credential.
var ErrUnauthenticated = errors.New("unauthenticated")

type authError struct{ msg string }

func (e *authError) Error() string        { return e.msg }
func (e *authError) Is(target error) bool { return target == ErrUnauthenticated }

// Authenticator checks API tokens against the database.
type Authenticator struct {
	DB *store.DB
}

// Authenticate returns the principal of an Authorization header value
// ("Bearer bct_…"). Refusals match ErrUnauthenticated and say why (missing,
// malformed, unknown, expired or revoked token); other errors are the
// database's.
func (a *Authenticator) Authenticate(ctx context.Context, authorization string) (Principal, error) {
	if authorization == "" {
		return Principal{}, &authError{"missing bearer token: set the Authorization header to \"Bearer <api token>\""}
	}
	scheme, secret, ok := strings.Cut(authorization, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return Principal{}, &authError{"authorization header must be \"Bearer <api token>\""}
	}
	secret = strings.TrimSpace(secret)
	if !strings.HasPrefix(secret, APITokenPrefix) || len(secret) > 256 {
		return Principal{}, &authError{"api token is not valid"}
	}
	tok, err := store.GetAPITokenByHash(ctx, a.DB.Pool, HashSecret(secret))
	if errors.Is(err, store.ErrNotFound) {
		return Principal{}, &authError{"api token is not valid"}
	}
	if err != nil {
		return Principal{}, err
	}
	now := a.DB.Now()
	if tok.RevokedAt != nil {
		return Principal{}, &authError{"api token was revoked"}
	}
	if tok.ExpiresAt != nil && !tok.ExpiresAt.After(now) {
		return Principal{}, &authError{"api token expired at " + tok.ExpiresAt.UTC().Format(time.RFC3339)}
	}
	role, err := ParseRole(tok.Role)
	if err != nil {
		return Principal{}, err
	}
	if err := store.TouchAPIToken(ctx, a.DB.Pool, tok.ID, now); err != nil {
		return Principal{}, err
	}
	return Principal{TokenID: tok.ID, TenantID: tok.TenantID, Role: role}, nil
}
