package iam

// CachedTokens returns how many tokens a caches.
func CachedTokens(a *Authenticator) int { return a.cache.count() }
