package iam

import (
	"crypto/sha256"
	"sync"
	"time"

	"github.com/better-compute/better-compute/pkg/store"
)

// cachedToken is what Authenticate keeps of a valid api_tokens row. Only
// tokens that were not revoked when read are cached, so it has no
// revocation time.
type cachedToken struct {
	id, tenantID string
	role         Role
	// expiresAt is nil for a token that never expires.
	expiresAt *time.Time
	// lastUsed is api_tokens.last_used_at as this process last read or
	// wrote it; zero for never.
	lastUsed time.Time
	// until is when the row must be read again.
	until time.Time
}

// expired reports whether t has expired at now.
func (t *cachedToken) expired(now time.Time) bool {
	return t.expiresAt != nil && !t.expiresAt.After(now)
}

// claimTouch reports whether a call at now is due to write last_used_at
// (store.TouchAPIToken, at most once per store.APITokenTouchInterval) and
// if so records now as t's last use, so that concurrent calls do not all
// write. An expired token is refused, so it is never due.
func (t *cachedToken) claimTouch(now time.Time) bool {
	if t.expired(now) || !t.lastUsed.IsZero() && !t.lastUsed.Before(now.Add(-store.APITokenTouchInterval)) {
		return false
	}
	t.lastUsed = now
	return true
}

// cachedRefusal is what Authenticate keeps of a well-formed token it
// refused after a query: unknown, revoked or expired.
type cachedRefusal struct {
	err *authError
	// until is when the token must be looked up again.
	until time.Time
}

// tokenCache maps token hashes to their rows (entries), to the refusals
// of recently refused tokens (refused), and keeps the hashes of the tokens
// last read valid (known). Its zero value is empty and ready.
type tokenCache struct {
	mu      sync.Mutex
	entries map[[sha256.Size]byte]*cachedToken
	refused map[[sha256.Size]byte]cachedRefusal
	// known holds the hashes of tokens whose last lookup found them valid,
	// however long ago: a source that Failures blocks may still have them
	// looked up (Authenticator.lookup). Only a valid row adds one, so a
	// caller without a valid token cannot grow it; a refusal drops it.
	known map[[sha256.Size]byte]struct{}
	// gen counts invalidations and mints: a row, or an absence, read while
	// one happened may be stale and is not cached.
	gen uint64
}

// get returns the fresh entry of hash, if any. When the entry is due for a
// last_used_at write (touch), it records now as its last use, so that only
// this call writes, and returns the previous value as prev.
func (c *tokenCache) get(hash [sha256.Size]byte, now time.Time) (tok cachedToken, touch bool, prev time.Time, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[hash]
	if e == nil || !now.Before(e.until) {
		return cachedToken{}, false, time.Time{}, false
	}
	prev = e.lastUsed
	touch = e.claimTouch(now)
	return *e, touch, prev, true
}

// generation returns the invalidation count, to pass to put.
func (c *tokenCache) generation() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

// put caches tok under hash unless an invalidation happened since
// generation returned gen. When the cache holds size entries (size ≤ 0:
// DefaultTokenCacheSize), it first drops the stale ones, and everything if
// that did not free half of it.
func (c *tokenCache) put(hash [sha256.Size]byte, tok cachedToken, gen uint64, now time.Time, size int) {
	if size <= 0 {
		size = DefaultTokenCacheSize
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen != gen {
		return
	}
	if c.entries == nil {
		c.entries = make(map[[sha256.Size]byte]*cachedToken)
	}
	if _, ok := c.entries[hash]; !ok && len(c.entries) >= size {
		for k, e := range c.entries {
			if !now.Before(e.until) {
				delete(c.entries, k)
			}
		}
		if len(c.entries) > size/2 {
			clear(c.entries)
		}
	}
	c.entries[hash] = &tok
}

// getRefusal returns the fresh refusal of hash, if any.
func (c *tokenCache) getRefusal(hash [sha256.Size]byte, now time.Time) (*authError, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.refused[hash]
	if !ok || !now.Before(r.until) {
		return nil, false
	}
	return r.err, true
}

// putRefusal caches err as the refusal of hash until until, unless an
// invalidation or a mint happened since generation returned gen, bounded
// like put.
func (c *tokenCache) putRefusal(hash [sha256.Size]byte, err *authError, gen uint64, now, until time.Time, size int) {
	if size <= 0 {
		size = DefaultTokenCacheSize
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen != gen {
		return
	}
	if c.refused == nil {
		c.refused = make(map[[sha256.Size]byte]cachedRefusal)
	}
	if _, ok := c.refused[hash]; !ok && len(c.refused) >= size {
		for k, r := range c.refused {
			if !now.Before(r.until) {
				delete(c.refused, k)
			}
		}
		if len(c.refused) > size/2 {
			clear(c.refused)
		}
	}
	c.refused[hash] = cachedRefusal{err: err, until: until}
}

// minted drops the refusal of hash, a token just created, and counts a
// mint, so that a lookup that read the token's absence before cannot cache
// it.
func (c *tokenCache) minted(hash [sha256.Size]byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	delete(c.refused, hash)
}

// untouch puts back prev as the last use of hash's entry after the
// last_used_at write that get or put recorded at now failed.
func (c *tokenCache) untouch(hash [sha256.Size]byte, now, prev time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.entries[hash]; e != nil && e.lastUsed.Equal(now) {
		e.lastUsed = prev
	}
}

// remove drops the entry of hash, if any, and forgets that it was valid.
func (c *tokenCache) remove(hash [sha256.Size]byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.entries, hash)
	delete(c.known, hash)
}

// vouch records that hash's token was just read valid. When the set holds
// size hashes (size ≤ 0: DefaultTokenCacheSize), half of them, chosen at
// random, are forgotten first.
func (c *tokenCache) vouch(hash [sha256.Size]byte, size int) {
	if size <= 0 {
		size = DefaultTokenCacheSize
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.known == nil {
		c.known = make(map[[sha256.Size]byte]struct{})
	}
	if _, ok := c.known[hash]; !ok && len(c.known) >= size {
		for k := range c.known { // map order is random
			if len(c.known) < size/2 {
				break
			}
			delete(c.known, k)
		}
	}
	c.known[hash] = struct{}{}
}

// isKnown reports whether hash's token was valid when last read.
func (c *tokenCache) isKnown(hash [sha256.Size]byte) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.known[hash]
	return ok
}

// invalidate drops the entries of token id, or all when id is empty, and
// counts an invalidation.
func (c *tokenCache) invalidate(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	if id == "" {
		clear(c.entries)
		return
	}
	for k, e := range c.entries {
		if e.id == id {
			delete(c.entries, k)
		}
	}
}

// count returns how many valid tokens are cached.
func (c *tokenCache) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// countRefused returns how many refusals are cached.
func (c *tokenCache) countRefused() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.refused)
}
