package joinservice

import (
	"context"
	"sync"
	"time"

	"github.com/better-compute/better-compute/pkg/store"
)

// tokenCheckTTL is how long a join token that store.CheckJoinToken found
// usable is taken as usable by the check before signing, without a
// statement: the machines of one token join in bursts, and each paid a read
// of the same row. The transaction that counts the use locks the row and
// checks it again (store.LockJoinToken), so a token revoked within this time
// is still refused, its certificate signed but never sent.
const tokenCheckTTL = time.Second

// maxCheckedTokens caps the tokens tokenChecks remembers; past it, it
// forgets them all.
const maxCheckedTokens = 1024

// tokenChecks remembers the join tokens found usable in the last
// tokenCheckTTL, by the hash of their secret.
type tokenChecks struct {
	mu sync.Mutex
	m  map[string]checkedToken
}

type checkedToken struct {
	token store.JoinToken
	at    time.Time
}

// check returns what store.CheckJoinToken returns for hash at now, from a
// read less than tokenCheckTTL old when there is one: its expiry is checked
// against now again. A refusal is never remembered.
func (c *tokenChecks) check(ctx context.Context, db *store.DB, hash []byte, now time.Time) (store.JoinToken, error) {
	key := string(hash)
	c.mu.Lock()
	e, ok := c.m[key]
	c.mu.Unlock()
	if ok && now.Sub(e.at) < tokenCheckTTL && now.Sub(e.at) >= 0 {
		if !e.token.ExpiresAt.After(now) {
			return e.token, &store.JoinTokenRefusal{Reason: store.ErrJoinTokenExpired, Token: e.token}
		}
		return e.token, nil
	}
	t, err := store.CheckJoinToken(ctx, db.Pool, hash, now)
	if err != nil {
		return t, err
	}
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxCheckedTokens {
		c.m = make(map[string]checkedToken)
	}
	c.m[key] = checkedToken{token: t, at: now}
	c.mu.Unlock()
	return t, nil
}
