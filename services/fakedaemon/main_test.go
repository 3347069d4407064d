package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseConfigDefaults(t *testing.T) {
	for _, k := range []string{"BC_JOIN_URL", "BC_JOIN_TOKEN_FILE", "BC_JOIN_TOKEN", "BC_JOIN_TOKEN_WAIT", "BC_DATA_DIR", "BC_VARIANT", "BC_NODES", "BC_GATEWAY_URL", "BC_GATEWAY_SERVER_NAME", "BC_HEALTH_LISTEN"} {
		t.Setenv(k, "")
	}
	cfg, err := parseConfig(nil)
	require.NoError(t, err)
	require.Equal(t, "http://joinservice:8081", cfg.JoinURL)
	require.Equal(t, "/var/lib/fakedaemon", cfg.DataDir)
	require.Equal(t, "hgx-h100", cfg.Variant)
	require.Equal(t, 1, cfg.Nodes)
	require.Equal(t, 2*time.Minute, cfg.TokenWait)
	require.Equal(t, ":8085", cfg.HealthListen)
}

func TestParseConfigEnvAndFlags(t *testing.T) {
	t.Setenv("BC_JOIN_URL", "http://j:1")
	t.Setenv("BC_JOIN_TOKEN_FILE", "/tok")
	t.Setenv("BC_JOIN_TOKEN", "bcjt_x")
	t.Setenv("BC_JOIN_TOKEN_WAIT", "5s")
	t.Setenv("BC_DATA_DIR", "/d")
	t.Setenv("BC_VARIANT", "l40s")
	t.Setenv("BC_NODES", "4")
	t.Setenv("BC_GATEWAY_URL", "https://g:8443")
	t.Setenv("BC_GATEWAY_SERVER_NAME", "gw")
	t.Setenv("BC_HEALTH_LISTEN", "127.0.0.1:9999")
	cfg, err := parseConfig([]string{"--nodes", "8", "--variant", "cpu", "--health-listen="})
	require.NoError(t, err)
	require.Equal(t, "http://j:1", cfg.JoinURL)
	require.Equal(t, "/tok", cfg.TokenFile)
	require.Equal(t, "bcjt_x", cfg.Token)
	require.Equal(t, 5*time.Second, cfg.TokenWait)
	require.Equal(t, "/d", cfg.DataDir)
	require.Equal(t, "cpu", cfg.Variant)
	require.Equal(t, 8, cfg.Nodes)
	require.Equal(t, "https://g:8443", cfg.GatewayURL)
	require.Equal(t, "gw", cfg.GatewayServerName)
	require.Empty(t, cfg.HealthListen, "an empty --health-listen turns the server off")
}

func TestParseConfigErrors(t *testing.T) {
	t.Setenv("BC_NODES", "")
	t.Setenv("BC_JOIN_TOKEN_WAIT", "")
	_, err := parseConfig([]string{"--nodes", "0"})
	require.ErrorContains(t, err, "--nodes must be at least 1")
	_, err = parseConfig([]string{"extra"})
	require.ErrorContains(t, err, `unexpected argument "extra"`)
	t.Setenv("BC_NODES", "many")
	_, err = parseConfig(nil)
	require.ErrorContains(t, err, "BC_NODES")
}
