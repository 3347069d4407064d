package main

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

// flags are the machine flags of `fakedaemon` and `fakedaemon join`, each
// with its environment variable's value as its default.
type flags struct {
	cfg                          fakedaemon.Config // what the flags set directly
	pinsFile, keysDir, durations string
	pins                         pki.Pins // the pin flags, each over the pins file's
	envErr                       error    // the first malformed variable
}

// addFlags defines the machine flags on fs, with the defaults the
// environment gives them. A malformed variable (BETTER_COMPUTE_NODES=many) is reported
// by config, naming it.
func addFlags(fs *pflag.FlagSet) *flags {
	f := &flags{}
	keep := func(err error) {
		if f.envErr == nil {
			f.envErr = err
		}
	}
	tokenWait, err := service.EnvDuration("BETTER_COMPUTE_JOIN_TOKEN_WAIT", agent.DefaultTokenWait)
	keep(err)
	silence, err := service.EnvDuration("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SILENCE_TIMEOUT", 0)
	keep(err)
	nodes := 1
	if v := os.Getenv("BETTER_COMPUTE_NODES"); v != "" {
		if nodes, err = strconv.Atoi(v); err != nil {
			keep(fmt.Errorf("BETTER_COMPUTE_NODES: %w", err))
		}
	}
	insecure := false
	if v := os.Getenv("BETTER_COMPUTE_INSECURE_TRUST_SERVER_PINS"); v != "" {
		if insecure, err = strconv.ParseBool(v); err != nil {
			keep(fmt.Errorf("BETTER_COMPUTE_INSECURE_TRUST_SERVER_PINS: %w", err))
		}
	}
	fs.SortFlags = false
	fs.StringVar(&f.cfg.Server, "server", os.Getenv("BETTER_COMPUTE_SERVER"), "the deployment's API base `URL`: its well-known document gives the join URL, the gateways and the join keys (env BETTER_COMPUTE_SERVER)")
	fs.StringVar(&f.pinsFile, "pins-file", os.Getenv("BETTER_COMPUTE_PINS_FILE"), "the deployment's pins.json at `PATH`, from better-compute pki init (env BETTER_COMPUTE_PINS_FILE)")
	fs.StringVar(&f.pins.ServingCA, "serving-ca-pin", os.Getenv("BETTER_COMPUTE_SERVING_CA_PIN"), "the `PIN` (sha256/<base64>) of the gateways' serving CA, over the pins file's; required to join (env BETTER_COMPUTE_SERVING_CA_PIN)")
	fs.StringVar(&f.pins.JoinSigning, "join-signing-pin", os.Getenv("BETTER_COMPUTE_JOIN_SIGNING_PIN"), "the `PIN` of JoinService's signing key, over the pins file's; required to join (env BETTER_COMPUTE_JOIN_SIGNING_PIN)")
	fs.StringVar(&f.pins.JoinEncryption, "join-encryption-pin", os.Getenv("BETTER_COMPUTE_JOIN_ENCRYPTION_PIN"), "the `PIN` of JoinService's HPKE key, over the pins file's; required to join (env BETTER_COMPUTE_JOIN_ENCRYPTION_PIN)")
	fs.StringVar(&f.pins.CommandSigning, "command-signing-pin", os.Getenv("BETTER_COMPUTE_COMMAND_SIGNING_PIN"), "the `PIN` of the command-signing root, over the pins file's; checked when given (env BETTER_COMPUTE_COMMAND_SIGNING_PIN)")
	fs.StringVar(&f.keysDir, "join-keys-dir", os.Getenv("BETTER_COMPUTE_JOIN_KEYS_DIR"), "a `DIR` holding join-encryption.pub and join-signing.pub (and command-signing.pub), instead of --server (env BETTER_COMPUTE_JOIN_KEYS_DIR)")
	fs.BoolVar(&f.cfg.InsecureTrustServerPins, "insecure-trust-server-pins", insecure, "INSECURE: take the pins from the server's own well-known document (trust on first use; development only) (env BETTER_COMPUTE_INSECURE_TRUST_SERVER_PINS)")
	fs.StringVar(&f.cfg.JoinURL, "join-url", os.Getenv("BETTER_COMPUTE_FAKEDAEMON_JOIN_URL"), "JoinService's base `URL` (default: the well-known document's, else "+fakedaemon.DefaultJoinURL+") (env BETTER_COMPUTE_FAKEDAEMON_JOIN_URL)")
	fs.StringVar(&f.cfg.TokenFile, "token-file", os.Getenv("BETTER_COMPUTE_JOIN_TOKEN_FILE"), "a file at `PATH` holding the join token, waited for; BETTER_COMPUTE_JOIN_TOKEN holds the token itself and wins (env BETTER_COMPUTE_JOIN_TOKEN_FILE)")
	fs.DurationVar(&f.cfg.TokenWait, "token-wait", tokenWait, "how long to wait for the token file to appear (env BETTER_COMPUTE_JOIN_TOKEN_WAIT)")
	fs.StringVar(&f.cfg.DataDir, "data-dir", service.Env("BETTER_COMPUTE_DATA_DIR", fakedaemon.DefaultDataDir), "the machines' directories: `PATH`/<index> holds machine index's identity and journal (env BETTER_COMPUTE_DATA_DIR)")
	fs.StringVar(&f.cfg.Variant, "variant", service.Env("BETTER_COMPUTE_VARIANT", fakedaemon.DefaultVariant), "the fake hardware (`NAME`) of machines that have not joined: "+strings.Join(fakehw.Variants(), ", ")+" (env BETTER_COMPUTE_VARIANT)")
	fs.IntVar(&f.cfg.Nodes, "nodes", nodes, fmt.Sprintf("machines to run in this process, 1 to %d (env BETTER_COMPUTE_NODES)", agent.MaxNodes))
	fs.StringVar(&f.cfg.GatewayURL, "gateway-url", os.Getenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_URL"), "the gateways (`URLS`), over the JoinResponse's: https://HOST[:PORT], comma-separated, one per replica; a machine moves to the next when it loses its session (env BETTER_COMPUTE_FAKEDAEMON_GATEWAY_URL)")
	fs.StringVar(&f.cfg.GatewayServerName, "gateway-server-name", os.Getenv("BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SERVER_NAME"), "the gateways' TLS server `NAME`, over the JoinResponse's (env BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SERVER_NAME)")
	fs.DurationVar(&f.cfg.Core.SilenceTimeout, "gateway-silence-timeout", silence, "drop a session that heard nothing from its gateway for this long and dial the next (0: 3 heartbeat intervals, at most 15s; never below 1.5 intervals) (env BETTER_COMPUTE_FAKEDAEMON_GATEWAY_SILENCE_TIMEOUT)")
	fs.StringVar(&f.cfg.HealthListen, "health-listen", service.Env("BETTER_COMPUTE_HEALTH_LISTEN", fakedaemon.DefaultHealthListen), "the address (`ADDR`) of the /healthz server; empty for none (env BETTER_COMPUTE_HEALTH_LISTEN)")
	fs.StringVar(&f.durations, "command-durations", os.Getenv("BETTER_COMPUTE_COMMAND_DURATIONS"), "how long fake commands take: a `LIST` of KIND=DURATION,… with KIND one of "+strings.Join(fakehw.Kinds(), ", ")+", or default for every kind not listed; unset: the usual durations (env BETTER_COMPUTE_COMMAND_DURATIONS)")
	return f
}

// config checks the flags and returns the configuration they make; joinOnly
// is the `join` subcommand. Every error names the flag or variable.
func (f *flags) config(joinOnly bool) (fakedaemon.Config, error) {
	cfg := f.cfg
	if f.envErr != nil {
		return cfg, f.envErr
	}
	if f.durations != "" {
		d, err := parseCommandDurations(f.durations)
		if err != nil {
			return cfg, fmt.Errorf("--command-durations: %w", err)
		}
		cfg.Durations = &d
	}
	if _, err := pki.ParseGatewayURLs(cfg.GatewayURL); err != nil {
		return cfg, fmt.Errorf("--gateway-url: %w", err)
	}
	if cfg.Core.SilenceTimeout < 0 {
		return cfg, fmt.Errorf("--gateway-silence-timeout must not be negative, got %s", cfg.Core.SilenceTimeout)
	}
	if cfg.Nodes < 1 || cfg.Nodes > agent.MaxNodes {
		return cfg, fmt.Errorf("--nodes must be from 1 to %d, got %d", agent.MaxNodes, cfg.Nodes)
	}
	if f.pinsFile != "" {
		fromFile, err := pki.ReadPinsFile(f.pinsFile)
		if err != nil {
			return cfg, fmt.Errorf("--pins-file: %w", err)
		}
		cfg.Pins = fromFile
	}
	for _, p := range []struct{ flag, v string }{
		{"--serving-ca-pin", f.pins.ServingCA}, {"--join-signing-pin", f.pins.JoinSigning},
		{"--join-encryption-pin", f.pins.JoinEncryption}, {"--command-signing-pin", f.pins.CommandSigning},
	} {
		if p.v == "" {
			continue
		}
		if _, err := pki.ParsePin(p.v); err != nil {
			return cfg, fmt.Errorf("%s: %w", p.flag, err)
		}
	}
	cfg.Pins = mergePins(cfg.Pins, f.pins)
	if f.keysDir != "" {
		var err error
		if cfg.JoinEncryptionKey, cfg.JoinSigningKey, err = pki.ReadJoinPublicKeys(f.keysDir); err != nil {
			return cfg, fmt.Errorf("--join-keys-dir: %w", err)
		}
		// Optional: with it, a command-signing pin is checked before Join.
		if _, cfg.CommandSigningKey, err = pki.LoadPublicKey(filepath.Join(f.keysDir, pki.CommandSigningPub)); err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				return cfg, fmt.Errorf("--join-keys-dir: %w", err)
			}
			cfg.CommandSigningKey = nil
		}
	}
	if cfg.InsecureTrustServerPins && cfg.Server == "" {
		return cfg, errors.New("--insecure-trust-server-pins needs --server")
	}
	if joinOnly {
		cfg.JoinOnly = true
		cfg.HealthListen = ""
	}
	cfg.Token = os.Getenv("BETTER_COMPUTE_JOIN_TOKEN")
	return cfg, nil
}

// parseCommandDurations parses the --command-durations list
// "KIND=DURATION,…" (items separated by commas, spaces around them
// ignored): each KIND one of fakehw.Kinds or "default", each DURATION a Go
// duration ≥ 0. It starts from fakehw.DefaultDurations and replaces the
// duration of each kind listed; with default=D, ByKind holds only the kinds
// listed and Default is D, so every other kind takes D. It fails for an
// empty list or item, an item without "=", an unknown or repeated kind, and
// a bad or negative duration, naming the item.
func parseCommandDurations(list string) (fakehw.Durations, error) {
	byKind := map[string]time.Duration{}
	var def *time.Duration
	for item := range strings.SplitSeq(list, ",") {
		item = strings.TrimSpace(item)
		kind, value, ok := strings.Cut(item, "=")
		kind, value = strings.TrimSpace(kind), strings.TrimSpace(value)
		switch {
		case item == "":
			return fakehw.Durations{}, fmt.Errorf("empty item in %q", list)
		case !ok || kind == "" || value == "":
			return fakehw.Durations{}, fmt.Errorf("item %q: want KIND=DURATION", item)
		case kind != "default" && !slices.Contains(fakehw.Kinds(), kind):
			return fakehw.Durations{}, fmt.Errorf("item %q: unknown command kind %q (valid: %s, default)",
				item, kind, strings.Join(fakehw.Kinds(), ", "))
		}
		d, err := time.ParseDuration(value)
		if err != nil {
			return fakehw.Durations{}, fmt.Errorf("item %q: %w", item, err)
		}
		if d < 0 {
			return fakehw.Durations{}, fmt.Errorf("item %q: duration must not be negative", item)
		}
		if _, dup := byKind[kind]; dup || (kind == "default" && def != nil) {
			return fakehw.Durations{}, fmt.Errorf("item %q: %s given twice", item, kind)
		}
		if kind == "default" {
			def = &d
			continue
		}
		byKind[kind] = d
	}
	out := fakehw.DefaultDurations()
	if def != nil {
		return fakehw.Durations{ByKind: byKind, Default: *def}, nil
	}
	maps.Copy(out.ByKind, byKind)
	return out, nil
}

// mergePins returns base with every pin set in over replacing its own.
func mergePins(base, over pki.Pins) pki.Pins {
	if over.ServingCA != "" {
		base.ServingCA = over.ServingCA
	}
	if over.JoinSigning != "" {
		base.JoinSigning = over.JoinSigning
	}
	if over.JoinEncryption != "" {
		base.JoinEncryption = over.JoinEncryption
	}
	if over.CommandSigning != "" {
		base.CommandSigning = over.CommandSigning
	}
	return base
}
