package store

// Join tokens (docs/architecture.md, "Join"): minted for a pool, used by
// JoinService once per machine (UseJoinToken, or UseJoinTokenN for a batch),
// and the keys that joined already (JoinedKeys: a retried Join).

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// JoinToken is a row of join_tokens: a secret that lets up to MaxUses
// machines join one pool until ExpiresAt. Only the SHA-256 of the secret is
// stored (Hash).
type JoinToken struct {
	ID     string
	PoolID string
	// Hash is SHA-256 of the token's secret.
	Hash      []byte
	MaxUses   int32
	Uses      int32
	ExpiresAt time.Time
	// RevokedAt is when the token was revoked; nil while it is not.
	RevokedAt *time.Time
	// CreatedBy names who minted the token (an API token id), for audit.
	CreatedBy string
	CreatedAt time.Time
}

// Sentinels of a refused join token; UseJoinToken returns them inside a
// *JoinTokenRefusal.
var (
	// ErrJoinTokenUnknown means no token has the secret's hash.
	ErrJoinTokenUnknown = errors.New("join token is not valid")
	// ErrJoinTokenExpired means the token's expiry has passed.
	ErrJoinTokenExpired = errors.New("join token expired")
	// ErrJoinTokenRevoked means the token was revoked.
	ErrJoinTokenRevoked = errors.New("join token was revoked")
	// ErrJoinTokenUsedUp means every use of the token was taken.
	ErrJoinTokenUsedUp = errors.New("join token is used up")
)

// JoinTokenRefusal says why UseJoinToken refused a token; errors.Is matches
// its Reason (one of the ErrJoinToken… sentinels).
type JoinTokenRefusal struct {
	// Reason is ErrJoinTokenUnknown, ErrJoinTokenExpired,
	// ErrJoinTokenRevoked or ErrJoinTokenUsedUp.
	Reason error
	// Token is the refused token; zero when Reason is ErrJoinTokenUnknown.
	Token JoinToken
}

// Error returns a sentence fit for the caller, e.g. "join token is used up
// (10 of 10 uses)".
func (e *JoinTokenRefusal) Error() string {
	switch {
	case errors.Is(e.Reason, ErrJoinTokenExpired):
		return fmt.Sprintf("join token expired at %s", e.Token.ExpiresAt.UTC().Format(time.RFC3339))
	case errors.Is(e.Reason, ErrJoinTokenUsedUp):
		return fmt.Sprintf("join token is used up (%d of %d uses)", e.Token.Uses, e.Token.MaxUses)
	default:
		return e.Reason.Error()
	}
}

// Unwrap returns Reason.
func (e *JoinTokenRefusal) Unwrap() error { return e.Reason }

// joinTokenColumns are the columns scanJoinToken reads, of join_tokens
// aliased j.
const joinTokenColumns = `j.id, j.pool_id, j.hash, j.max_uses, j.uses, j.expires_at, j.revoked_at, j.created_by,
	j.created_at`

func scanJoinToken(row pgx.Row) (JoinToken, error) {
	var t JoinToken
	err := row.Scan(&t.ID, &t.PoolID, &t.Hash, &t.MaxUses, &t.Uses, &t.ExpiresAt, &t.RevokedAt, &t.CreatedBy, &t.CreatedAt)
	return t, err
}

// CreateJoinToken inserts t (Uses is ignored: a new token has none) for a
// pool that scope owns. Errors: ErrNotFound when the pool does not exist
// or its owner is outside scope.
func CreateJoinToken(ctx context.Context, q DBTX, scope Scope, t JoinToken) error {
	if err := checkPoolOwned(ctx, q, scope, t.PoolID); err != nil {
		return err
	}
	_, err := q.Exec(ctx, `INSERT INTO join_tokens (id, pool_id, hash, max_uses, expires_at, created_by, created_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7)`, t.ID, t.PoolID, t.Hash, t.MaxUses, t.ExpiresAt, t.CreatedBy, t.CreatedAt)
	if err != nil {
		return queryErr("create join token", err)
	}
	return nil
}

// GetJoinToken returns the join token with id when scope includes its
// pool's owner (a join token is its pool owner's, even where the pool is
// offered). Errors: ErrNotFound (missing, or outside scope).
func GetJoinToken(ctx context.Context, q DBTX, scope Scope, id string) (JoinToken, error) {
	t, err := scanJoinToken(q.QueryRow(ctx, `SELECT `+joinTokenColumns+` FROM join_tokens j
		JOIN pools p ON p.id = j.pool_id WHERE j.id = $1 AND ($2::text IS NULL OR p.owner_tenant_id = $2)`,
		id, scope.arg()))
	if err != nil {
		return JoinToken{}, queryErr(fmt.Sprintf("join token %s", id), err)
	}
	return t, nil
}

// GetJoinTokenByHash returns the join token whose secret hashes to hash.
// Errors: ErrNotFound.
func GetJoinTokenByHash(ctx context.Context, q DBTX, hash []byte) (JoinToken, error) {
	t, err := scanJoinToken(q.QueryRow(ctx, `SELECT `+joinTokenColumns+` FROM join_tokens j WHERE j.hash = $1`, hash))
	if err != nil {
		return JoinToken{}, queryErr("join token", err)
	}
	return t, nil
}

// JoinTokenFilter narrows ListJoinTokens; zero fields other than Scope
// match everything.
type JoinTokenFilter struct {
	// Scope keeps the tokens of pools its tenants own (the zero Scope:
	// none).
	Scope  Scope
	PoolID string
}

// ListJoinTokens returns the join tokens matching f ordered by id.
func ListJoinTokens(ctx context.Context, q DBTX, f JoinTokenFilter) ([]JoinToken, error) {
	rows, err := q.Query(ctx, `SELECT `+joinTokenColumns+` FROM join_tokens j JOIN pools p ON p.id = j.pool_id
		WHERE ($1 = '' OR j.pool_id = $1) AND ($2::text IS NULL OR p.owner_tenant_id = $2) ORDER BY j.id`,
		f.PoolID, f.Scope.arg())
	if err != nil {
		return nil, queryErr("list join tokens", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (JoinToken, error) { return scanJoinToken(r) })
	if err != nil {
		return nil, queryErr("list join tokens", err)
	}
	return out, nil
}

// RevokeJoinToken revokes token id at now and returns it; revoking a revoked
// token keeps its first revocation time. Errors: ErrNotFound (missing, or
// its pool's owner outside scope).
func RevokeJoinToken(ctx context.Context, q DBTX, scope Scope, id string, now time.Time) (JoinToken, error) {
	t, err := scanJoinToken(q.QueryRow(ctx, `UPDATE join_tokens j SET revoked_at = COALESCE(j.revoked_at, $2)
		FROM pools p WHERE j.id = $1 AND p.id = j.pool_id AND ($3::text IS NULL OR p.owner_tenant_id = $3)
		RETURNING `+joinTokenColumns, id, now, scope.arg()))
	if err != nil {
		return JoinToken{}, queryErr(fmt.Sprintf("join token %s", id), err)
	}
	return t, nil
}

// UseJoinToken counts one use of the token whose secret hashes to hash and
// returns it with the use counted. The count is one conditional UPDATE, so
// concurrent joins can never take more than max_uses uses; call it in the
// transaction that creates the node so that a failed join gives the use
// back.
//
// Errors: a *JoinTokenRefusal (errors.Is ErrJoinTokenUnknown,
// ErrJoinTokenRevoked, ErrJoinTokenExpired or ErrJoinTokenUsedUp) when the
// token cannot be used; nothing is counted then.
func UseJoinToken(ctx context.Context, q DBTX, hash []byte, now time.Time) (JoinToken, error) {
	for attempt := 0; ; attempt++ {
		t, err := scanJoinToken(q.QueryRow(ctx, `UPDATE join_tokens j SET uses = j.uses + 1
			WHERE j.hash = $1 AND j.uses < j.max_uses AND j.revoked_at IS NULL AND j.expires_at > $2
			RETURNING `+joinTokenColumns, hash, now))
		if err == nil {
			return t, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return JoinToken{}, queryErr("use join token", err)
		}
		// Nothing was counted; find out why for the caller.
		t, err = GetJoinTokenByHash(ctx, q, hash)
		switch {
		case errors.Is(err, ErrNotFound):
			return JoinToken{}, &JoinTokenRefusal{Reason: ErrJoinTokenUnknown}
		case err != nil:
			return JoinToken{}, err
		case t.RevokedAt != nil:
			return JoinToken{}, &JoinTokenRefusal{Reason: ErrJoinTokenRevoked, Token: t}
		case !t.ExpiresAt.After(now):
			return JoinToken{}, &JoinTokenRefusal{Reason: ErrJoinTokenExpired, Token: t}
		case t.Uses >= t.MaxUses || attempt >= 2:
			return JoinToken{}, &JoinTokenRefusal{Reason: ErrJoinTokenUsedUp, Token: t}
		}
		// The token changed between the two statements (a statement sees
		// only what was committed when it started): try again.
	}
}

// UseJoinTokenN counts up to n uses of the token whose secret hashes to hash,
// for a batch of n joins in one transaction. It locks the token row (FOR
// UPDATE), so concurrent batches queue behind each other and can never take
// more than max_uses uses in all. It returns the token as it was before the
// uses were counted and how many were granted (1 to n): the first granted
// joins of the batch get them, the rest are refused as used up.
//
// Errors: a *JoinTokenRefusal (errors.Is ErrJoinTokenUnknown,
// ErrJoinTokenRevoked, ErrJoinTokenExpired or ErrJoinTokenUsedUp) when no use
// can be granted; nothing is counted then.
func UseJoinTokenN(ctx context.Context, q DBTX, hash []byte, n int, now time.Time) (JoinToken, int, error) {
	t, err := LockJoinToken(ctx, q, hash, now)
	if err != nil {
		return t, 0, err
	}
	granted, err := CountJoinTokenUses(ctx, q, t, n)
	return t, granted, err
}

// LockJoinToken locks the row of the token whose secret hashes to hash (FOR
// UPDATE, until the transaction ends) and returns it. Errors: a
// *JoinTokenRefusal (ErrJoinTokenUnknown, ErrJoinTokenRevoked or
// ErrJoinTokenExpired); whether uses are left is CountJoinTokenUses's to
// say.
func LockJoinToken(ctx context.Context, q DBTX, hash []byte, now time.Time) (JoinToken, error) {
	t, err := scanJoinToken(q.QueryRow(ctx, `SELECT `+joinTokenColumns+` FROM join_tokens j WHERE j.hash = $1 FOR UPDATE`, hash))
	return usableJoinToken(t, err, now)
}

// CheckJoinToken makes LockJoinToken's checks of the token whose secret
// hashes to hash without locking it, for a caller that refuses an unusable
// token before it spends work on the join (JoinService signs nothing for an
// unknown, revoked or expired token). Errors: as LockJoinToken's.
func CheckJoinToken(ctx context.Context, q DBTX, hash []byte, now time.Time) (JoinToken, error) {
	t, err := scanJoinToken(q.QueryRow(ctx, `SELECT `+joinTokenColumns+` FROM join_tokens j WHERE j.hash = $1`, hash))
	return usableJoinToken(t, err, now)
}

// usableJoinToken turns the read of a join token into LockJoinToken's
// answer.
func usableJoinToken(t JoinToken, err error, now time.Time) (JoinToken, error) {
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return JoinToken{}, &JoinTokenRefusal{Reason: ErrJoinTokenUnknown}
	case err != nil:
		return JoinToken{}, queryErr("lock join token", err)
	case t.RevokedAt != nil:
		return t, &JoinTokenRefusal{Reason: ErrJoinTokenRevoked, Token: t}
	case !t.ExpiresAt.After(now):
		return t, &JoinTokenRefusal{Reason: ErrJoinTokenExpired, Token: t}
	}
	return t, nil
}

// CountJoinTokenUses counts up to n uses of t, locked by LockJoinToken in
// this transaction, and returns how many were granted (1 to n). Errors: a
// *JoinTokenRefusal (ErrJoinTokenUsedUp) when none is left.
func CountJoinTokenUses(ctx context.Context, q DBTX, t JoinToken, n int) (int, error) {
	granted, err := GrantJoinTokenUses(t, n)
	if err != nil {
		return 0, err
	}
	if _, err := q.Exec(ctx, `UPDATE join_tokens SET uses = uses + $2 WHERE id = $1`, t.ID, granted); err != nil {
		return 0, queryErr("use join token", err)
	}
	return granted, nil
}

// GrantJoinTokenUses returns how many of n uses t, locked by LockJoinToken
// in this transaction, has left (1 to n), counting nothing: RecordJoins
// counts them with the joins. Errors: a *JoinTokenRefusal
// (ErrJoinTokenUsedUp) when none is left.
func GrantJoinTokenUses(t JoinToken, n int) (int, error) {
	if t.Uses >= t.MaxUses {
		return 0, &JoinTokenRefusal{Reason: ErrJoinTokenUsedUp, Token: t}
	}
	return min(n, int(t.MaxUses-t.Uses)), nil
}

// JoinedKey is a node that a public key joined as.
type JoinedKey struct {
	// NodeID is the node and PoolID its pool.
	NodeID, PoolID string
}

// JoinedKeys returns, by hex SHA-256 of the SubjectPublicKeyInfo, the nodes
// that the keys of keys (pki.PublicKeySHA256 values) joined as
// (nodes.join_key_sha256).
func JoinedKeys(ctx context.Context, q DBTX, keys [][]byte) (map[string]JoinedKey, error) {
	rows, err := q.Query(ctx, `SELECT n.join_key_sha256, n.id, n.pool_id FROM nodes n WHERE n.join_key_sha256 = ANY($1)`, keys)
	if err != nil {
		return nil, queryErr("joined keys", err)
	}
	defer rows.Close()
	out := map[string]JoinedKey{}
	for rows.Next() {
		var key []byte
		var j JoinedKey
		if err := rows.Scan(&key, &j.NodeID, &j.PoolID); err != nil {
			return nil, queryErr("joined keys", err)
		}
		out[hex.EncodeToString(key)] = j
	}
	if err := rows.Err(); err != nil {
		return nil, queryErr("joined keys", err)
	}
	return out, nil
}
