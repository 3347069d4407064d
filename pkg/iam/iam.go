// Package iam authenticates API callers and decides what they may do.
//
// Callers present an API token ("bct_" + 32 random bytes in base64url) as
// `Authorization: Bearer <token>`. Only the token's SHA-256 is stored
// (api_tokens.hash), with its tenant, one Role, an optional expiry and a
// revocation time. A Role grants Permissions; a Principal holds the caller's
// tenant and role, and may touch a tenant's resources when it belongs to that
// tenant or is a root administrator. Tenants form a tree under the root
// tenant, but rights never flow down it: a tenant's tokens see that tenant
// only. Another tenant's resource reads as NotFound, never as
// PermissionDenied, so that ids do not leak.
//
// An Authenticator caches the rows of valid tokens for a second
// (DefaultTokenCacheTTL) so that a busy client costs no query per call;
// revoking a token drops it from the revoking server's cache at once and
// from the others' when the revocation's NATS message arrives. It caches
// refusals of well-formed tokens for two seconds (DefaultRefusalCacheTTL),
// and may limit failed authentications per source address
// (Authenticator.Failures, pkg/ratelimit); every refusal is counted in the
// bc.auth.failures metric (see Authenticate).
//
// Every mutating RPC called by an authenticated caller is audited
// (audit.go): NewAuditInterceptor writes one row per call, refusals
// included, and a handler writes its success row in the transaction of its
// change with AuditInTx. A call that fails authentication names nobody and
// writes no row: bc.auth.failures counts it.
//
// To extend it: add a Permission constant and grant it to roles in
// rolePermissions (the single table of who may do what); then name it in
// the per-RPC table of the service that needs it
// (services/api/api/authz.go).
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

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/ratelimit"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Role is what an API token may do, within its tenant or, for RoleRootAdmin,
// everywhere.
type Role string

// The roles, as stored in api_tokens.role.
const (
	// RoleRootAdmin may do everything in every tenant: create tenants and
	// sites, mint tokens of any tenant and role. Its tokens belong to the
	// root tenant.
	RoleRootAdmin Role = "root-admin"
	// RoleTenantAdmin manages its tenant: pools, join tokens, node
	// revocation, API tokens (up to tenant-admin), and reads its audit log.
	RoleTenantAdmin Role = "tenant-admin"
	// RoleTenantMember uses its tenant's fleet: reserves and releases GPUs.
	RoleTenantMember Role = "tenant-member"
	// RoleViewer only reads its tenant's fleet, reservations and usage.
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
	// PermFleetManage creates pools, mints, lists and revokes join tokens,
	// and revokes nodes.
	PermFleetManage Permission = "fleet.manage"
	// PermSitesManage creates sites. Sites are places shared by every
	// tenant, so only root administrators create them.
	PermSitesManage Permission = "sites.manage"
	// PermTenantsRead lists the tenants the caller sees (its own, or all
	// for a root administrator).
	PermTenantsRead Permission = "tenants.read"
	// PermTenantsManage creates tenants.
	PermTenantsManage Permission = "tenants.manage"
	// PermIAMManage mints, lists and revokes API tokens. Which tenant and
	// role a caller may mint for is the handler's rule (no stronger than
	// its own, its own tenant unless root-admin).
	PermIAMManage Permission = "iam.manage"
	// PermAuditRead lists the audit log (the caller's tenant's, or all for
	// a root administrator).
	PermAuditRead Permission = "audit.read"
	// PermReservationsRead gets and lists the reservations of the caller's
	// tenant (all for a root administrator).
	PermReservationsRead Permission = "reservations.read"
	// PermReservationsWrite reserves GPUs of pools offered to the caller's
	// tenant and releases its reservations.
	PermReservationsWrite Permission = "reservations.write"
	// PermUsageRead lists usage windows (the caller's tenant's, or any
	// tenant's for a root administrator).
	PermUsageRead Permission = "usage.read"
	// PermCommandsRun runs commands (diag.nvml, inventory.refresh,
	// logs.collect, node.reboot) on the nodes of the caller's tenant (any
	// node for a root administrator). Rebooting a machine is an operator
	// action, so only administrators hold it.
	PermCommandsRun Permission = "commands.run"
	// PermCommandsRead gets and lists the commands of the caller's tenant's
	// nodes (all for a root administrator).
	PermCommandsRead Permission = "commands.read"
	// PermEventsRead watches the events stream: the caller's tenant's
	// events, or every tenant's for a root administrator.
	PermEventsRead Permission = "events.read"
	// PermNodesAccess opens a shell on the nodes of the caller's tenant
	// (any node for a root administrator) and takes break-glass SSH
	// certificates for them (principal root): an operator's access to the
	// machine itself, so only administrators hold it. A tenant's access to
	// the sandbox of its own reservation needs PermReservationsWrite
	// instead (docs/architecture.md, "Tunnels").
	PermNodesAccess Permission = "nodes.access"
)

// rolePermissions is the single table of what each role may do.
var rolePermissions = map[Role][]Permission{
	RoleRootAdmin: {PermFleetRead, PermFleetManage, PermSitesManage, PermTenantsRead, PermTenantsManage,
		PermIAMManage, PermAuditRead, PermReservationsRead, PermReservationsWrite, PermUsageRead,
		PermCommandsRun, PermCommandsRead, PermEventsRead, PermNodesAccess},
	RoleTenantAdmin: {PermFleetRead, PermFleetManage, PermTenantsRead, PermIAMManage, PermAuditRead,
		PermReservationsRead, PermReservationsWrite, PermUsageRead, PermCommandsRun, PermCommandsRead, PermEventsRead,
		PermNodesAccess},
	RoleTenantMember: {PermFleetRead, PermTenantsRead, PermReservationsRead, PermReservationsWrite, PermUsageRead,
		PermCommandsRead, PermEventsRead},
	RoleViewer: {PermFleetRead, PermTenantsRead, PermReservationsRead, PermUsageRead, PermCommandsRead, PermEventsRead},
}

// Permissions lists every permission, in the order of the table above.
func Permissions() []Permission {
	return []Permission{PermFleetRead, PermFleetManage, PermSitesManage, PermTenantsRead, PermTenantsManage,
		PermIAMManage, PermAuditRead, PermReservationsRead, PermReservationsWrite, PermUsageRead,
		PermCommandsRun, PermCommandsRead, PermEventsRead, PermNodesAccess}
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
	// TenantID is the tenant the token belongs to ("ten_…").
	TenantID string
	// Role is the token's role.
	Role Role
	// ExpiresAt is when the token expires, nil for never. A token it mints
	// may not outlive it.
	ExpiresAt *time.Time
}

// rank is a role's place in Roles, 0 for the most powerful; an unknown
// role ranks below every known one.
func (r Role) rank() int {
	for i, q := range Roles() {
		if q == r {
			return i
		}
	}
	return len(Roles())
}

// MayGrant reports whether p may mint, or revoke, a token of role r: one no
// stronger than its own (a tenant-admin may not touch root-admin tokens).
// Which tenant it may act in is Principal.Scope's question.
func (p Principal) MayGrant(r Role) bool {
	return r.rank() < len(Roles()) && p.Role.rank() <= r.rank()
}

// IsRoot reports whether p is a root administrator.
func (p Principal) IsRoot() bool { return p.Role == RoleRootAdmin }

// Can reports whether p holds permission perm.
func (p Principal) Can(perm Permission) bool { return p.Role.Grants(perm) }

// Scope is the one place that decides whose tenant-owned rows p may read
// and change: its own tenant's, or every tenant's for a root administrator
// (store.AllTenants). Handlers pass it to every store function that reads
// or writes such rows, which apply it in their queries (store.Scope).
func (p Principal) Scope() store.Scope {
	if p.IsRoot() {
		return store.AllTenants
	}
	return store.TenantScope(p.TenantID)
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

// authError is a refusal of Authenticate: msg says what was wrong, reason
// is the bounded label of bc.auth.failures (one of the reason constants).
type authError struct{ reason, msg string }

func (e *authError) Error() string        { return e.msg }
func (e *authError) Is(target error) bool { return target == ErrUnauthenticated }

// The reasons of refusals, as bc.auth.failures labels them.
const (
	reasonMissing   = "missing"   // no Authorization header
	reasonMalformed = "malformed" // another scheme, or not a well-formed token
	reasonUnknown   = "unknown"   // a well-formed token that was never minted
	reasonRevoked   = "revoked"
	reasonExpired   = "expired"
	reasonThrottled = "throttled" // the source failed too often (ThrottledError)
)

// ThrottledError is AuthenticateFrom's refusal of a source address that
// failed to authenticate more often than Authenticator.Failures allows:
// its token was not looked at. RetryAfter is how long until the source
// may try again.
type ThrottledError struct{ RetryAfter time.Duration }

func (e *ThrottledError) Error() string {
	return fmt.Sprintf("failed authentications from this address: too many; retry in %d s",
		ratelimit.RetrySeconds(e.RetryAfter))
}

// authFailures counts refused authentications by reason (the reason
// constants); a refused call writes no audit row, this counts it instead.
// It is made on the global MeterProvider (telemetry.SetupMetrics sets it).
var authFailures = telemetry.Int64Counter(otel.Meter("github.com/better-compute/better-compute/pkg/iam"), telemetry.AuthFailures)

// Authenticator checks API tokens against the database, and caches the
// rows of valid tokens for CacheTTL so that a busy caller does not cost a
// query per request (see Authenticate for what the cache may and may not
// change). Make it with NewAuthenticator; it is safe for concurrent use and
// must not be copied after first use.
type Authenticator struct {
	DB *store.DB
	// CacheTTL is how long a valid token's row, once read, answers later
	// calls with that token before it is read again; zero or negative
	// caches nothing (every call reads the row). NewAuthenticator sets
	// DefaultTokenCacheTTL.
	CacheTTL time.Duration
	// CacheSize caps how many tokens are cached, and apart from them how
	// many refusals; zero or negative is DefaultTokenCacheSize.
	CacheSize int
	// RefusalCacheTTL is how long a well-formed token refused after a
	// query (unknown, revoked, expired) is refused again without one; zero
	// or negative caches no refusal. NewAuthenticator sets
	// DefaultRefusalCacheTTL. See Authenticate for why a token minted a
	// moment ago is not refused by it.
	RefusalCacheTTL time.Duration
	// Failures, when set, limits failed authentications per source address
	// (AuthenticateFrom): only a refused call spends one of the source's
	// tokens. Once a source has spent its burst, its calls are refused with
	// ThrottledError before their token is looked up, except those with a
	// token this Authenticator last read valid (cached or not): a flood of
	// bad calls from an address does not lock out a valid token there. Nil:
	// no limit.
	Failures *ratelimit.Limiter

	cache tokenCache
}

// Defaults of NewAuthenticator.
const (
	// DefaultTokenCacheTTL is the default Authenticator.CacheTTL: 1 s, the
	// longest a revoked token keeps working on an API server other than the
	// one that revoked it when the revocation message is lost.
	DefaultTokenCacheTTL = time.Second
	// DefaultTokenCacheSize is the default Authenticator.CacheSize: 10,000
	// tokens.
	DefaultTokenCacheSize = 10000
	// DefaultRefusalCacheTTL is the default Authenticator.RefusalCacheTTL:
	// 2 s, long enough that a client retrying a bad token in a loop costs
	// a query every 2 s, short enough that a refusal never outlives a
	// fix by much.
	DefaultRefusalCacheTTL = 2 * time.Second
)

// NewAuthenticator returns an Authenticator over db that caches token rows
// for DefaultTokenCacheTTL and refusals for DefaultRefusalCacheTTL, with no
// limit on failures.
func NewAuthenticator(db *store.DB) *Authenticator {
	return &Authenticator{DB: db, CacheTTL: DefaultTokenCacheTTL, CacheSize: DefaultTokenCacheSize,
		RefusalCacheTTL: DefaultRefusalCacheTTL}
}

// secretChars is the length of a secret's random part: 32 bytes in
// unpadded base64url.
const secretChars = 43

// ParseBearer returns the API token in an Authorization header value. It
// accepts exactly `Bearer bct_<43 base64url characters>`: the scheme
// case-insensitive and followed by one or more spaces (RFC 6750 section
// 2.1, RFC 9110 section 11.1), the token the canonical unpadded base64url
// encoding of 32 bytes (RFC 4648 section 5) after its prefix, and nothing
// else. Errors match ErrUnauthenticated and say what is wrong (missing
// header, another scheme, a malformed token); it never touches a database.
func ParseBearer(header string) (string, error) {
	if header == "" {
		return "", &authError{reasonMissing, "missing bearer token: set the Authorization header to \"Bearer <api token>\""}
	}
	scheme, rest, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", &authError{reasonMalformed, "authorization header must be \"Bearer <api token>\""}
	}
	secret := strings.TrimLeft(rest, " ")
	if !wellFormedSecret(secret, APITokenPrefix) {
		return "", &authError{reasonMalformed, "api token is not valid"}
	}
	return secret, nil
}

// wellFormedSecret reports whether s is prefix followed by the canonical
// unpadded base64url encoding of 32 bytes, as NewSecret makes.
func wellFormedSecret(s, prefix string) bool {
	body, ok := strings.CutPrefix(s, prefix)
	if !ok || len(body) != secretChars {
		return false
	}
	for i := 0; i < len(body); i++ {
		if !isBase64URL(body[i]) {
			return false
		}
	}
	// Strict refuses a last character with stray low bits, so one token has
	// one spelling.
	b, err := base64.RawURLEncoding.Strict().DecodeString(body)
	return err == nil && len(b) == 32
}

// isBase64URL reports whether c is in the base64url alphabet (RFC 4648
// section 5), without padding.
func isBase64URL(c byte) bool {
	return 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_'
}

// Authenticate returns the principal of an Authorization header value
// ("Bearer bct_…", see ParseBearer). Refusals match ErrUnauthenticated and
// say why (missing, malformed, unknown, expired or revoked token); other
// errors are the database's. It is AuthenticateFrom with no source: never
// throttled.
//
// The row of a valid token is cached for CacheTTL (by the token's hash).
// Expiry is checked against the clock on every call, cached or not. A
// revocation is seen:
//   - at once by the API server that revoked the token, which calls
//     Invalidate after its commit;
//   - on other API servers as soon as the revocation's outbox message
//     (store.SubjectAPITokenRevoked) reaches them and they call Invalidate;
//   - within CacheTTL at worst, when that message is lost or late.
//
// A well-formed token refused after a query (unknown, revoked, expired) is
// refused from the cache for RefusalCacheTTL, so that a client retrying a
// bad token costs no query per call; the cache holds at most CacheSize
// refusals. Revoked and expired are for ever. Unknown is not, and yet a
// token minted a moment ago is never refused by a cached "unknown": a
// secret is 32 bytes from crypto/rand drawn by MintAPIToken, so nobody can
// present it before it is minted, and no refusal of its hash can have been
// cached before then. Should that fail (a secret chosen outside
// MintAPIToken), the minting server forgets the refusal at once (Minted,
// which the API's CreateToken calls after its commit; a lookup that read
// the absence before that caches nothing), and any other server within
// RefusalCacheTTL.
//
// last_used_at is written at most once per store.APITokenTouchInterval per
// token and process: the cache remembers the last write.
func (a *Authenticator) Authenticate(ctx context.Context, authorization string) (Principal, error) {
	return a.AuthenticateFrom(ctx, authorization, "")
}

// AuthenticateFrom is Authenticate for a call from source (a key of
// ratelimit.Source; "" for none): every refusal counts in bc.auth.failures
// and, with Failures set, spends one of source's tokens; a call that
// authenticates spends none. A source with no token left is refused with
// *ThrottledError (not ErrUnauthenticated) before its token is looked up
// in the database, unless this Authenticator's last lookup of that token
// found it valid (however long ago, and whether or not its row is still
// cached): a flood of bad calls from an address does not lock out a client
// there whose token is known good, while unknown tokens from it cost no
// query. A valid token this process never read (after a restart, or one
// minted on another API server and never used here) is throttled with the
// rest until the source's tokens refill.
func (a *Authenticator) AuthenticateFrom(ctx context.Context, authorization, source string) (Principal, error) {
	p, err := a.authenticate(ctx, authorization, source)
	var (
		aerr *authError
		terr *ThrottledError
	)
	switch {
	case errors.As(err, &terr):
		authFailures.Add(ctx, 1, metric.WithAttributes(attribute.String("reason", reasonThrottled)))
	case errors.As(err, &aerr):
		if a.Failures != nil && source != "" {
			if ok, retry := a.Failures.Allow(source); !ok {
				authFailures.Add(ctx, 1, metric.WithAttributes(attribute.String("reason", reasonThrottled)))
				return Principal{}, &ThrottledError{RetryAfter: retry}
			}
		}
		authFailures.Add(ctx, 1, metric.WithAttributes(attribute.String("reason", aerr.reason)))
	}
	return p, err
}

func (a *Authenticator) authenticate(ctx context.Context, authorization, source string) (Principal, error) {
	secret, err := ParseBearer(authorization)
	if err != nil {
		return Principal{}, err
	}
	hash := sha256.Sum256([]byte(secret))
	now := a.DB.Now()
	tok, touch, prevUse, err := a.lookup(ctx, hash, now, source)
	if err != nil {
		return Principal{}, err
	}
	if tok.expired(now) {
		return Principal{}, &authError{reasonExpired, "api token expired at " + tok.expiresAt.UTC().Format(time.RFC3339)}
	}
	// TouchAPIToken writes at most once a minute; the row (or the cache)
	// tells whether this call is due, so most calls skip the round trip.
	// lookup has already recorded the touch, so that concurrent calls do
	// not all write; a failed write puts the old time back.
	if touch {
		if err := store.TouchAPIToken(ctx, a.DB.Pool, tok.id, now); err != nil {
			a.cache.untouch(hash, now, prevUse)
			return Principal{}, err
		}
	}
	p := Principal{TokenID: tok.id, TenantID: tok.tenantID, Role: tok.role}
	if tok.expiresAt != nil {
		exp := *tok.expiresAt // the cache's copy stays its own
		p.ExpiresAt = &exp
	}
	return p, nil
}

// lookup returns the token whose secret hashes to hash, from the cache while
// its entry is fresh, else from the database (and then caches it unless it
// is expired). A revoked, expired or unknown token is a refusal, cached for
// RefusalCacheTTL; a source that Failures blocks is refused before the
// database is read unless hash's token was valid when last read. touch reports whether this call is the one to write
// last_used_at: then the returned (and cached) lastUsed is already now, and
// prev is its value before.
func (a *Authenticator) lookup(ctx context.Context, hash [sha256.Size]byte, now time.Time, source string) (tok cachedToken, touch bool, prev time.Time, err error) {
	ttl := a.CacheTTL
	if ttl > 0 {
		if tok, touch, prev, ok := a.cache.get(hash, now); ok {
			return tok, touch, prev, nil
		}
	}
	if refusal, ok := a.cache.getRefusal(hash, now); ok {
		return cachedToken{}, false, time.Time{}, refusal
	}
	if a.Failures != nil && source != "" {
		if blocked, retry := a.Failures.Blocked(source); blocked && !a.cache.isKnown(hash) {
			return cachedToken{}, false, time.Time{}, &ThrottledError{RetryAfter: retry}
		}
	}
	gen := a.cache.generation()
	refuse := func(reason, msg string) (cachedToken, bool, time.Time, error) {
		a.cache.remove(hash) // its stale entry, if any
		e := &authError{reason, msg}
		if a.RefusalCacheTTL > 0 {
			a.cache.putRefusal(hash, e, gen, now, now.Add(a.RefusalCacheTTL), a.CacheSize)
		}
		return cachedToken{}, false, time.Time{}, e
	}
	row, err := store.GetAPITokenByHash(ctx, a.DB.Pool, hash[:])
	if errors.Is(err, store.ErrNotFound) {
		return refuse(reasonUnknown, "api token is not valid")
	}
	if err != nil {
		return cachedToken{}, false, time.Time{}, err
	}
	if row.RevokedAt != nil {
		return refuse(reasonRevoked, "api token was revoked")
	}
	if row.ExpiresAt != nil && !row.ExpiresAt.After(now) {
		return refuse(reasonExpired, "api token expired at "+row.ExpiresAt.UTC().Format(time.RFC3339))
	}
	role, err := ParseRole(row.Role)
	if err != nil {
		return cachedToken{}, false, time.Time{}, err
	}
	tok = cachedToken{id: row.ID, tenantID: row.TenantID, role: role, expiresAt: row.ExpiresAt, until: now.Add(ttl)}
	if row.LastUsedAt != nil {
		tok.lastUsed = *row.LastUsedAt
	}
	prev = tok.lastUsed
	touch = tok.claimTouch(now)
	a.cache.vouch(hash, a.CacheSize)
	if ttl > 0 {
		a.cache.put(hash, tok, gen, now, a.CacheSize)
	}
	return tok, touch, prev, nil
}

// Minted tells the Authenticator that a token whose secret hashes to hash
// (store.APIToken.Hash) was just created and committed: a refusal of it
// cached before is dropped (see Authenticate). Call it after the commit of
// a MintAPIToken.
func (a *Authenticator) Minted(hash []byte) {
	var h [sha256.Size]byte
	if copy(h[:], hash) != sha256.Size {
		return
	}
	a.cache.minted(h)
}

// Invalidate drops the cached row of token tokenID ("tok_…"), or every
// cached row when tokenID is empty, so that the next call with that token
// reads the database; a lookup that was reading the database meanwhile does
// not cache what it read. Call it after the commit of a change that may
// refuse a token: the revoking handler does, and API servers do for each
// store.SubjectAPITokenRevoked message.
func (a *Authenticator) Invalidate(tokenID string) { a.cache.invalidate(tokenID) }
