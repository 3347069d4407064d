package gateway

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/config"
)

// TestGCPercent: the gateway binary sets the garbage collector's target to
// GATEWAY_GC_PERCENT (25 by default) unless GOGC is set, which wins. Not
// parallel: the target is the process's.
func TestGCPercent(t *testing.T) {
	prev := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(prev) })

	var cfg Config
	config.SetDefaults(&cfg)
	require.Equal(t, 25, cfg.GCPercent)

	noEnv := func(string) string { return "" }
	require.True(t, applyGCPercent(cfg.GCPercent, noEnv))
	require.Equal(t, 25, debug.SetGCPercent(100), "the target is GCPercent")

	gogc := func(k string) string {
		if k == "GOGC" {
			return "200"
		}
		return ""
	}
	require.False(t, applyGCPercent(cfg.GCPercent, gogc))
	require.Equal(t, 100, debug.SetGCPercent(100), "GOGC wins")
}
