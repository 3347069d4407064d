package joinservice

import (
	"context"
	"errors"
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
// tokenCheckTTL, by the hash of their secret, and reads each token once at
// a time: the joins that miss it while a read of their token is in flight
// wait for that read instead of sending the same statement (a burst of
// joins found the token's entry expired together, and each read it).
type tokenChecks struct {
	mu sync.Mutex
	m  map[string]checkedToken
	// reads are the reads in flight, by the hash of their token's secret.
	reads map[string]*tokenRead
}

type checkedToken struct {
	token store.JoinToken
	at    time.Time
}

// tokenRead is a read of a token in flight: done is closed once token and
// err hold its outcome.
type tokenRead struct {
	done  chan struct{}
	token store.JoinToken
	err   error
}

// check returns what store.CheckJoinToken returns for hash at now, from a
// read less than tokenCheckTTL old, or in flight, when there is one: its
// expiry is checked against now again. A refusal is never remembered; a
// read in flight that fails otherwise (its caller gone, the database) is not
// shared, and its waiters read for themselves.
func (c *tokenChecks) check(ctx context.Context, db *store.DB, hash []byte, now time.Time) (store.JoinToken, error) {
	key := string(hash)
	c.mu.Lock()
	e, ok := c.m[key]
	if ok && now.Sub(e.at) < tokenCheckTTL && now.Sub(e.at) >= 0 {
		c.mu.Unlock()
		return checkExpiry(e.token, now)
	}
	if r := c.reads[key]; r != nil {
		c.mu.Unlock()
		select {
		case <-r.done:
		case <-ctx.Done():
			return store.JoinToken{}, ctx.Err()
		}
		var refusal *store.JoinTokenRefusal
		switch {
		case r.err == nil:
			return checkExpiry(r.token, now)
		case errors.As(r.err, &refusal):
			return r.token, r.err
		}
		return store.CheckJoinToken(ctx, db.Pool, hash, now)
	}
	r := &tokenRead{done: make(chan struct{})}
	if c.reads == nil {
		c.reads = make(map[string]*tokenRead)
	}
	c.reads[key] = r
	c.mu.Unlock()

	r.token, r.err = store.CheckJoinToken(ctx, db.Pool, hash, now)
	c.mu.Lock()
	delete(c.reads, key)
	if r.err == nil {
		if c.m == nil || len(c.m) >= maxCheckedTokens {
			c.m = make(map[string]checkedToken)
		}
		c.m[key] = checkedToken{token: r.token, at: now}
	}
	c.mu.Unlock()
	close(r.done)
	return r.token, r.err
}

// checkExpiry returns t, refused as expired when its expiry is not after
// now.
func checkExpiry(t store.JoinToken, now time.Time) (store.JoinToken, error) {
	if !t.ExpiresAt.After(now) {
		return t, &store.JoinTokenRefusal{Reason: store.ErrJoinTokenExpired, Token: t}
	}
	return t, nil
}
