package iam

// CachedTokens returns how many tokens a caches.
func CachedTokens(a *Authenticator) int { return a.cache.count() }

// CachedRefusals returns how many refused tokens a caches.
func CachedRefusals(a *Authenticator) int { return a.cache.countRefused() }
