package iam

import (
	"crypto/sha256"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestTokenCacheBounds(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	var c tokenCache
	key := func(i int) [sha256.Size]byte { return sha256.Sum256([]byte{byte(i)}) }
	put := func(i int, until time.Time) {
		c.put(key(i), cachedToken{id: "tok_x", until: until}, c.generation(), now, 4)
	}

	// Full of fresh entries: everything goes.
	for i := range 4 {
		put(i, now.Add(time.Second))
	}
	require.Equal(t, 4, c.count())
	put(4, now.Add(time.Second))
	require.Equal(t, 1, c.count(), "cleared when full of fresh entries")

	// Full with stale entries: only they go.
	put(5, now)
	put(6, now.Add(-time.Second))
	put(7, now)
	require.Equal(t, 4, c.count())
	put(8, now.Add(time.Second))
	require.Equal(t, 2, c.count(), "the stale entries dropped, the fresh kept")
	_, _, _, ok := c.get(key(4), now)
	require.True(t, ok)
	_, _, _, ok = c.get(key(5), now)
	require.False(t, ok)

	// A row read before an invalidation is not cached.
	gen := c.generation()
	c.invalidate("tok_other")
	c.put(key(9), cachedToken{id: "tok_y", until: now.Add(time.Second)}, gen, now, 4)
	_, _, _, ok = c.get(key(9), now)
	require.False(t, ok, "stale read not cached")
	require.Equal(t, 2, c.count())
}

// TestTokenCacheRefusals checks that a refusal read before a mint is not
// cached after it, that Minted drops a cached one, and the bound.
func TestTokenCacheRefusals(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	var c tokenCache
	key := func(i int) [sha256.Size]byte { return sha256.Sum256([]byte{byte(i)}) }
	refusal := &authError{reasonUnknown, "api token is not valid"}
	until := now.Add(time.Second)

	c.putRefusal(key(1), refusal, c.generation(), now, until, 4)
	got, ok := c.getRefusal(key(1), now)
	require.True(t, ok)
	require.Equal(t, refusal, got)
	_, ok = c.getRefusal(key(1), until)
	require.False(t, ok, "stale at its TTL")

	c.minted(key(1))
	_, ok = c.getRefusal(key(1), now)
	require.False(t, ok, "a mint drops its refusal")

	// The absence was read, then the token was minted: not cached.
	gen := c.generation()
	c.minted(key(2))
	c.putRefusal(key(2), refusal, gen, now, until, 4)
	_, ok = c.getRefusal(key(2), now)
	require.False(t, ok, "an absence read before a mint is stale")

	for i := range 10 {
		c.putRefusal(key(10+i), refusal, c.generation(), now, until, 4)
		require.LessOrEqual(t, c.countRefused(), 4)
	}
}
