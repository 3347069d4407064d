package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
	"github.com/better-compute/better-compute/services/fakedaemon/flags"
)

// clearEnv unsets every variable of the fakedaemon for the test.
func clearEnv(t *testing.T) {
	for _, v := range flags.Vars() {
		t.Setenv(v.Name, "")
	}
}

// parseConfig runs `fakedaemon args` (`fakedaemon join args` when
// joinOnly) up to the machines and returns the configuration they would
// run with, or the error the command ends with.
func parseConfig(args []string, joinOnly bool) (fakedaemon.Config, error) {
	var got fakedaemon.Config
	root := newRoot(func(_ context.Context, cfg fakedaemon.Config, _ io.Writer) error {
		got = cfg
		return nil
	})
	if joinOnly {
		args = append([]string{"join"}, args...)
	}
	root.SetArgs(args)
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	return got, root.ExecuteContext(context.Background())
}

func TestParseConfigDefaults(t *testing.T) {
	clearEnv(t)
	cfg, err := parseConfig(nil, false)
	require.NoError(t, err)
	require.Empty(t, cfg.JoinURL, "the Runner defaults it: from the well-known document, else joinservice")
	require.Empty(t, cfg.Server)
	require.Equal(t, pki.Pins{}, cfg.Pins)
	require.False(t, cfg.InsecureTrustServerPins)
	require.False(t, cfg.JoinOnly)
	require.Equal(t, "/var/lib/fakedaemon", cfg.DataDir)
	require.Equal(t, "hgx-h100", cfg.Variant)
	require.Equal(t, 1, cfg.Nodes)
	require.Equal(t, agent.DefaultJoinConcurrency, cfg.JoinConcurrency)
	require.Equal(t, 2*time.Minute, cfg.TokenWait)
	require.Equal(t, ":8085", cfg.HealthListen)
	require.Nil(t, cfg.Durations, "unset: the machines' usual command durations")
	require.Zero(t, cfg.Core.SilenceTimeout, "unset: the daemon core's default")
}

func TestParseConfigSilenceTimeout(t *testing.T) {
	clearEnv(t)
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SILENCE_TIMEOUT", "20s")
	cfg, err := parseConfig(nil, false)
	require.NoError(t, err)
	require.Equal(t, 20*time.Second, cfg.Core.SilenceTimeout)
	cfg, err = parseConfig([]string{"--gateway-silence-timeout", "12s"}, false)
	require.NoError(t, err)
	require.Equal(t, 12*time.Second, cfg.Core.SilenceTimeout)
	_, err = parseConfig([]string{"--gateway-silence-timeout", "-1s"}, false)
	require.EqualError(t, err, "--gateway-silence-timeout must not be negative, got -1s")
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SILENCE_TIMEOUT", "soon")
	_, err = parseConfig(nil, false)
	require.ErrorContains(t, err, "BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SILENCE_TIMEOUT")
}

func TestParseConfigEnvAndFlags(t *testing.T) {
	clearEnv(t)
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_JOIN_URL", "http://j:1")
	t.Setenv("BETTER_COMPUTE_JOIN_TOKEN_FILE", "/tok")
	t.Setenv("BETTER_COMPUTE_JOIN_TOKEN", "bcjt_x")
	t.Setenv("BETTER_COMPUTE_JOIN_TOKEN_WAIT", "5s")
	t.Setenv("BETTER_COMPUTE_DATA_DIR", "/d")
	t.Setenv("BETTER_COMPUTE_VARIANT", "l40s")
	t.Setenv("BETTER_COMPUTE_NODES", "4")
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_JOIN_CONCURRENCY", "40")
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_URL", "https://g:8443")
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SERVER_NAME", "gw")
	t.Setenv("BETTER_COMPUTE_HEALTH_LISTEN", "127.0.0.1:9999")
	t.Setenv("BETTER_COMPUTE_SERVER", "http://api:8080")
	cfg, err := parseConfig([]string{"--nodes", "8", "--variant", "cpu", "--health-listen="}, false)
	require.NoError(t, err)
	require.Equal(t, "http://j:1", cfg.JoinURL)
	require.Equal(t, "http://api:8080", cfg.Server)
	require.Equal(t, "/tok", cfg.TokenFile)
	require.Equal(t, "bcjt_x", cfg.Token)
	require.Equal(t, 5*time.Second, cfg.TokenWait)
	require.Equal(t, "/d", cfg.DataDir)
	require.Equal(t, "cpu", cfg.Variant)
	require.Equal(t, 8, cfg.Nodes)
	require.Equal(t, 40, cfg.JoinConcurrency)
	require.Equal(t, "https://g:8443", cfg.GatewayURL)
	require.Equal(t, "gw", cfg.GatewayServerName)
	require.Empty(t, cfg.HealthListen, "an empty --health-listen turns the server off")
}

// TestParseConfigPinsAndKeys: pins come from the pins file, each flag
// (or its variable) overriding the file's; the join keys from a directory.
func TestParseConfigPinsAndKeys(t *testing.T) {
	clearEnv(t)
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, clock.New().Now())
	require.NoError(t, err)
	filePins, err := pki.ReadPins(dir)
	require.NoError(t, err)
	otherPin := pki.PinOfSPKI([]byte("another key"))
	t.Setenv("BETTER_COMPUTE_COMMAND_SIGNING_PIN", otherPin)
	cfg, err := parseConfig([]string{"--pins-file", filepath.Join(dir, pki.PinsJSON), "--serving-ca-pin", otherPin,
		"--join-keys-dir", dir}, false)
	require.NoError(t, err)
	want := filePins
	want.ServingCA, want.CommandSigning = otherPin, otherPin
	require.Equal(t, want, cfg.Pins)
	enc, sig, err := pki.ReadJoinPublicKeys(dir)
	require.NoError(t, err)
	require.Equal(t, enc, cfg.JoinEncryptionKey)
	require.Equal(t, sig, cfg.JoinSigningKey)
}

func TestParseConfigJoin(t *testing.T) {
	clearEnv(t)
	t.Setenv("BETTER_COMPUTE_INSECURE_TRUST_SERVER_PINS", "true")
	cfg, err := parseConfig([]string{"--server", "http://127.0.0.1:8080"}, true)
	require.NoError(t, err)
	require.True(t, cfg.JoinOnly)
	require.True(t, cfg.InsecureTrustServerPins)
	require.Empty(t, cfg.HealthListen, "joining only serves no health endpoint")
}

func TestParseConfigErrors(t *testing.T) {
	clearEnv(t)
	_, err := parseConfig([]string{"--nodes", "0"}, false)
	require.ErrorContains(t, err, "--nodes must be from 1 to 20000, got 0")
	_, err = parseConfig([]string{"--nodes", "100000000"}, false)
	require.ErrorContains(t, err, "--nodes must be from 1 to 20000, got 100000000")
	_, err = parseConfig([]string{"--join-concurrency", "0"}, false)
	require.ErrorContains(t, err, "--join-concurrency must be from 1 to 20000, got 0")
	cfg, err := parseConfig([]string{"--join-concurrency", "128"}, false)
	require.NoError(t, err)
	require.Equal(t, 128, cfg.JoinConcurrency)
	_, err = parseConfig([]string{"extra"}, false)
	require.ErrorContains(t, err, `unexpected argument "extra"`)
	_, err = parseConfig([]string{"--join-signing-pin", "sha1/abc"}, false)
	require.ErrorContains(t, err, `--join-signing-pin: pin "sha1/abc" does not start with "sha256/"`)
	_, err = parseConfig([]string{"--pins-file", filepath.Join(t.TempDir(), "missing.json")}, false)
	require.ErrorContains(t, err, "--pins-file")
	_, err = parseConfig([]string{"--join-keys-dir", t.TempDir()}, false)
	require.ErrorContains(t, err, "--join-keys-dir")
	_, err = parseConfig([]string{"--insecure-trust-server-pins"}, true)
	require.ErrorContains(t, err, "--insecure-trust-server-pins needs --server")
	t.Setenv("BETTER_COMPUTE_NODES", "many")
	_, err = parseConfig(nil, false)
	require.ErrorContains(t, err, "BETTER_COMPUTE_NODES")
}

// TestParseConfigGatewayURL: --gateway-url (or BETTER_COMPUTE_FAKEDAEMON_GATEWAY_URL) must be
// https URLs with a host; a malformed one is refused at startup naming the
// flag, instead of machines failing later at their first session.
func TestParseConfigGatewayURL(t *testing.T) {
	clearEnv(t)
	for flag, want := range map[string]string{
		"gateway:8443":                  `--gateway-url: gateway URL "gateway:8443" must be https://HOST[:PORT] (the session uses mutual TLS)`,
		"http://gateway:8443":           `--gateway-url: gateway URL "http://gateway:8443" must be https://HOST[:PORT]`,
		"https://:8443":                 `--gateway-url: gateway URL "https://:8443" has no host`,
		"https://gw-a:8443,gw-b":        `--gateway-url: gateway URL "gw-b" must be https://HOST[:PORT]`,
		",":                             `--gateway-url: gateway URL list "," has no URL`,
		"https://gw-a:8443,https://gw:": "",
	} {
		cfg, err := parseConfig([]string{"--gateway-url", flag}, false)
		if want == "" {
			require.NoError(t, err, flag)
			require.Equal(t, flag, cfg.GatewayURL)
			continue
		}
		require.ErrorContains(t, err, want, flag)
	}
	t.Setenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_URL", "ftp://gw")
	_, err := parseConfig(nil, false)
	require.ErrorContains(t, err, `--gateway-url: gateway URL "ftp://gw" must be https://HOST[:PORT]`)
	cfg, err := parseConfig([]string{"--gateway-url", "https://gw:8443, https://gw-b:8443"}, false)
	require.NoError(t, err, "the flag wins over the variable")
	require.Equal(t, "https://gw:8443, https://gw-b:8443", cfg.GatewayURL)
}

// TestParseConfigCommandDurations: --command-durations (or
// BETTER_COMPUTE_COMMAND_DURATIONS) sets Config.Durations; a bad list names the flag.
func TestParseConfigCommandDurations(t *testing.T) {
	clearEnv(t)
	t.Setenv("BETTER_COMPUTE_COMMAND_DURATIONS", "default=5s")
	cfg, err := parseConfig(nil, false)
	require.NoError(t, err)
	require.Equal(t, &fakehw.Durations{ByKind: map[string]time.Duration{}, Default: 5 * time.Second}, cfg.Durations)
	cfg, err = parseConfig([]string{"--command-durations", "diag.nvml=0"}, false)
	require.NoError(t, err, "the flag wins over the variable")
	require.NotNil(t, cfg.Durations)
	require.Equal(t, time.Duration(0), cfg.Durations.ByKind["diag.nvml"])
	require.Equal(t, fakehw.DefaultDurations().ByKind["logs.collect"], cfg.Durations.ByKind["logs.collect"])
	cfg, err = parseConfig([]string{"--command-durations="}, false)
	require.NoError(t, err)
	require.Nil(t, cfg.Durations, "an empty list is the usual durations")
	_, err = parseConfig([]string{"--command-durations", "diag.nvml=-1s"}, false)
	require.EqualError(t, err, `--command-durations: item "diag.nvml=-1s": duration must not be negative`)
	t.Setenv("BETTER_COMPUTE_COMMAND_DURATIONS", "reset=1s")
	_, err = parseConfig(nil, true)
	require.ErrorContains(t, err, `--command-durations: item "reset=1s": unknown command kind "reset"`)
}

func TestRunJoinRefusesWithoutPins(t *testing.T) {
	clearEnv(t)
	t.Setenv("BETTER_COMPUTE_JOIN_TOKEN", "bcjt_x")
	cfg, err := parseConfig([]string{"--server", "http://127.0.0.1:1", "--data-dir", t.TempDir()}, true)
	require.NoError(t, err)
	var out bytes.Buffer
	err = run(t.Context(), cfg, &out)
	require.ErrorContains(t, err, "refusing to join a deployment it cannot authenticate")
	require.Empty(t, out.String())
	_, statErr := os.Stat(filepath.Join(cfg.DataDir, "0", "node.json"))
	require.ErrorIs(t, statErr, os.ErrNotExist)
}

// TestCommands: the command tree's help, exit statuses and healthcheck.
func TestCommands(t *testing.T) {
	clearEnv(t)
	exec := func(run runFunc, args ...string) (code int, stdout, stderr string) {
		var out, errOut bytes.Buffer
		root := newRoot(run)
		root.SetOut(&out)
		code = execute(t.Context(), root, args, &errOut)
		return code, out.String(), errOut.String()
	}
	ran := 0
	counting := func(context.Context, fakedaemon.Config, io.Writer) error { ran++; return nil }

	code, out, _ := exec(counting, "--help")
	require.Zero(t, code)
	require.Contains(t, out, "fakedaemon [flags]")
	require.Contains(t, out, "--server URL")
	require.Contains(t, out, "(env BETTER_COMPUTE_SERVER)")
	require.Contains(t, out, "(env BETTER_COMPUTE_HEALTH_LISTEN)")
	require.Contains(t, out, "join ")
	require.Contains(t, out, "healthcheck ")
	code, out, _ = exec(counting, "join", "--help")
	require.Zero(t, code)
	require.Contains(t, out, "fakedaemon join [flags]")
	require.Contains(t, out, "(env BETTER_COMPUTE_PINS_FILE)")
	require.NotContains(t, out, "--health-listen", "joining only serves no /healthz")
	code, out, _ = exec(counting, "healthcheck", "--help")
	require.Zero(t, code)
	require.Contains(t, out, "fakedaemon healthcheck [URL]")
	require.Zero(t, ran, "help runs nothing")

	for _, args := range [][]string{{"extra"}, {"--nodes", "x"}, {"join", "--bogus"}, {"join", "extra"}, {"--nodes", "0"}} {
		code, _, errOut := exec(counting, args...)
		require.Equal(t, 2, code, "%v: a usage error", args)
		require.True(t, strings.HasPrefix(errOut, "fakedaemon: "), errOut)
	}
	require.Zero(t, ran)

	code, _, errOut := exec(func(context.Context, fakedaemon.Config, io.Writer) error { return errors.New("boom") })
	require.Equal(t, 1, code)
	require.Equal(t, "fakedaemon: boom\n", errOut)
	code, _, _ = exec(counting)
	require.Zero(t, code)
	code, _, _ = exec(counting, "join")
	require.Zero(t, code)
	require.Equal(t, 2, ran)

	healthy := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer healthy.Close()
	unhealthy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer unhealthy.Close()
	code, _, _ = exec(counting, "healthcheck", healthy.URL)
	require.Zero(t, code)
	code, _, _ = exec(counting, "healthcheck", unhealthy.URL)
	require.Equal(t, 1, code)
	code, _, _ = exec(counting, "healthcheck", healthy.URL, "extra")
	require.Equal(t, 2, code, "at most one URL")
}
