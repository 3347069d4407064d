// Package flags defines the machine flags of the fakedaemon command
// (`fakedaemon` and `fakedaemon join`), each with the environment variable
// that sets its default, checks them into a fakedaemon.Config, and lists
// the variables (Vars) for the configuration reference,
// docs/configuration.md, which cmd/better-compute/internal/genconfig writes
// from them.
//
// To add a flag, define it in Add through one of the Flags helpers (str,
// boolean, integer, duration), which name its variable in its usage and
// annotate the flag with it, so that `fakedaemon --help` and Vars show it;
// check it in Config; and run `make generate`.
package flags

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
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

// EnvAnnotation is the key of the flag annotation (pflag.Flag.Annotations)
// that holds the name of the flag's environment variable.
const EnvAnnotation = "better-compute/env"

// JoinTokenVar is the variable that holds the join token itself; it has no
// flag (a token on a command line would show in the process list).
const JoinTokenVar = config.Prefix + "JOIN_TOKEN"

// joinTokenUsage is what JoinTokenVar means, as Vars says it.
const joinTokenUsage = "the join token itself; it wins over --token-file"

// Flags are the machine flags of `fakedaemon` and `fakedaemon join`, each
// with its environment variable's value as its default.
type Flags struct {
	fs                           *pflag.FlagSet
	getenv                       func(string) string
	cfg                          fakedaemon.Config // what the flags set directly
	pinsFile, keysDir, durations string
	pins                         pki.Pins // the pin flags, each over the pins file's
	envErr                       error    // the first malformed variable
}

// Add defines the machine flags on fs, with the defaults the environment
// (getenv, usually os.Getenv) gives them. A malformed variable
// (BETTER_COMPUTE_NODES=many) is reported by Config, naming it.
func Add(fs *pflag.FlagSet, getenv func(string) string) *Flags {
	f := &Flags{fs: fs, getenv: getenv}
	const p = config.Prefix
	fs.SortFlags = false
	f.str(&f.cfg.Server, "server", p+"SERVER", "", "the deployment's API base `URL`: its well-known document gives the join URL, the gateways and the join keys")
	f.str(&f.pinsFile, "pins-file", p+"PINS_FILE", "", "the deployment's pins.json at `PATH`, from better-compute pki init")
	f.str(&f.pins.ServingCA, "serving-ca-pin", p+"SERVING_CA_PIN", "", "the `PIN` (sha256/<base64>) of the gateways' serving CA, over the pins file's; required to join")
	f.str(&f.pins.JoinSigning, "join-signing-pin", p+"JOIN_SIGNING_PIN", "", "the `PIN` of JoinService's signing key, over the pins file's; required to join")
	f.str(&f.pins.JoinEncryption, "join-encryption-pin", p+"JOIN_ENCRYPTION_PIN", "", "the `PIN` of JoinService's HPKE key, over the pins file's; required to join")
	f.str(&f.pins.CommandSigning, "command-signing-pin", p+"COMMAND_SIGNING_PIN", "", "the `PIN` of the command-signing root, over the pins file's; checked when given")
	f.str(&f.keysDir, "join-keys-dir", p+"JOIN_KEYS_DIR", "", "a `DIR` holding join-encryption.pub and join-signing.pub (and command-signing.pub), instead of --server")
	f.boolean(&f.cfg.InsecureTrustServerPins, "insecure-trust-server-pins", p+"INSECURE_TRUST_SERVER_PINS", false, "INSECURE: take the pins from the server's own well-known document (trust on first use; development only)")
	f.str(&f.cfg.JoinURL, "join-url", p+"FAKEDAEMON_JOIN_URL", "", "JoinService's base `URL` (default: the well-known document's, else "+fakedaemon.DefaultJoinURL+")")
	f.str(&f.cfg.TokenFile, "token-file", p+"JOIN_TOKEN_FILE", "", "a file at `PATH` holding the join token, waited for; "+JoinTokenVar+" holds the token itself and wins")
	f.duration(&f.cfg.TokenWait, "token-wait", p+"JOIN_TOKEN_WAIT", agent.DefaultTokenWait, "how long to wait for the token file to appear")
	f.str(&f.cfg.DataDir, "data-dir", p+"DATA_DIR", fakedaemon.DefaultDataDir, "the machines' directories: `PATH`/<index> holds machine index's identity and journal")
	f.str(&f.cfg.Variant, "variant", p+"VARIANT", fakedaemon.DefaultVariant, "the fake hardware (`NAME`) of machines that have not joined: "+strings.Join(fakehw.Variants(), ", "))
	f.integer(&f.cfg.Nodes, "nodes", p+"NODES", 1, fmt.Sprintf("machines to run in this process, 1 to %d", agent.MaxNodes))
	f.integer(&f.cfg.JoinConcurrency, "join-concurrency", p+"FAKEDAEMON_JOIN_CONCURRENCY", agent.DefaultJoinConcurrency,
		fmt.Sprintf("how many of the machines may be joining at once (Join calls in flight), 1 to %d; more makes a large --nodes join faster where JoinService's per-address rate limit allows it", agent.MaxNodes))
	f.str(&f.cfg.GatewayURL, "gateway-url", p+"FAKEDAEMON_GATEWAY_URL", "", "the gateways (`URLS`), over the JoinResponse's: https://HOST[:PORT], comma-separated, one per replica; a machine moves to the next when it loses its session")
	f.str(&f.cfg.SessionTransport, "session-transport", p+"FAKEDAEMON_SESSION_TRANSPORT", agent.SessionFramed,
		"how sessions reach the gateways (`NAME`): "+agent.SessionFramed+" (a TLS connection of its own per session; "+agent.SessionConnect+" for a gateway without it) or "+agent.SessionConnect+" (Connect streams over HTTP/2)")
	f.str(&f.cfg.GatewayServerName, "gateway-server-name", p+"FAKEDAEMON_GATEWAY_SERVER_NAME", "", "the gateways' TLS server `NAME`, over the JoinResponse's")
	f.duration(&f.cfg.Core.SilenceTimeout, "gateway-silence-timeout", p+"FAKEDAEMON_GATEWAY_SILENCE_TIMEOUT", 0, "drop a session that heard nothing from its gateway for this long and dial the next (0: 3 heartbeat intervals, at most 15s; never below 1.5 intervals)")
	f.str(&f.cfg.HealthListen, "health-listen", p+"HEALTH_LISTEN", fakedaemon.DefaultHealthListen, "the address (`ADDR`) of the /healthz server; empty for none")
	f.str(&f.cfg.PprofListen, "pprof-listen", p+"PPROF_LISTEN", "", "the address (`ADDR`) of a plain-HTTP server of the process's Go runtime profiles (/debug/pprof/), as the services serve them; empty for none. Bind it to loopback")
	f.str(&f.durations, "command-durations", p+"COMMAND_DURATIONS", "", "how long fake commands take: a `LIST` of KIND=DURATION,… with KIND one of "+strings.Join(fakehw.Kinds(), ", ")+", or default for every kind not listed; unset: the usual durations")
	return f
}

// str defines a string flag whose default is the variable env, else def.
func (f *Flags) str(p *string, name, env, def, usage string) {
	if v := f.getenv(env); v != "" {
		def = v
	}
	f.fs.StringVar(p, name, def, usage)
	f.annotate(name, env)
}

// boolean defines a bool flag whose default is the variable env
// (strconv.ParseBool), else def.
func (f *Flags) boolean(p *bool, name, env string, def bool, usage string) {
	if v := f.getenv(env); v != "" {
		b, err := strconv.ParseBool(v)
		f.keep(env, err)
		if err == nil {
			def = b
		}
	}
	f.fs.BoolVar(p, name, def, usage)
	f.annotate(name, env)
}

// integer defines an int flag whose default is the variable env, else def.
func (f *Flags) integer(p *int, name, env string, def int, usage string) {
	if v := f.getenv(env); v != "" {
		n, err := strconv.Atoi(v)
		f.keep(env, err)
		if err == nil {
			def = n
		}
	}
	f.fs.IntVar(p, name, def, usage)
	f.annotate(name, env)
}

// duration defines a duration flag whose default is the variable env (Go
// syntax, "5s"), else def.
func (f *Flags) duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	if v := f.getenv(env); v != "" {
		d, err := time.ParseDuration(v)
		f.keep(env, err)
		if err == nil {
			def = d
		}
	}
	f.fs.DurationVar(p, name, def, usage)
	f.annotate(name, env)
}

// annotate names env in the usage of the flag name, as `--help` shows it,
// and in its EnvAnnotation, as Vars reads it.
func (f *Flags) annotate(name, env string) {
	fl := f.fs.Lookup(name)
	fl.Usage += " (env " + env + ")"
	if fl.Annotations == nil {
		fl.Annotations = map[string][]string{}
	}
	fl.Annotations[EnvAnnotation] = []string{env}
}

// keep records err, the first only, as a malformed value of env.
func (f *Flags) keep(env string, err error) {
	if err != nil && f.envErr == nil {
		f.envErr = fmt.Errorf("%s: %w", env, err)
	}
}

// Var is an environment variable of the fakedaemon, as Vars lists it.
type Var struct {
	// Name is the variable's full name, config.Prefix included.
	Name string
	// Flag is the flag whose default it sets, without "--" ("" for
	// JoinTokenVar, which has none), and Placeholder the flag's value as
	// its usage names it between backquotes and `--help` shows it (URL,
	// PATH; "" when the usage names none).
	Flag, Placeholder string
	// Type is the flag's pflag type: string, bool, int or duration.
	Type string
	// Default is the flag's default when the variable is unset, as pflag
	// prints it (2m0s, false; "" for none).
	Default string
	// Usage is what the flag means: its usage, without the placeholder's
	// backquotes and the variable's name.
	Usage string
}

// Vars lists the fakedaemon's variables: one per machine flag, in the
// flags' order, with its default regardless of the environment, then
// JoinTokenVar.
func Vars() []Var {
	fs := pflag.NewFlagSet("fakedaemon", pflag.ContinueOnError)
	Add(fs, func(string) string { return "" })
	var vars []Var
	fs.VisitAll(func(fl *pflag.Flag) {
		env := fl.Annotations[EnvAnnotation]
		if len(env) != 1 {
			return
		}
		placeholder, usage := pflag.UnquoteUsage(fl)
		if !strings.Contains(fl.Usage, "`") {
			placeholder = "" // pflag's stand-in, the type's name
		}
		vars = append(vars, Var{Name: env[0], Flag: fl.Name, Placeholder: placeholder, Type: fl.Value.Type(),
			Default: fl.DefValue, Usage: strings.TrimSuffix(usage, " (env "+env[0]+")")})
	})
	return append(vars, Var{Name: JoinTokenVar, Type: "string", Usage: joinTokenUsage})
}

// Config checks the flags and returns the configuration they make; joinOnly
// is the `join` subcommand. Every error names the flag or variable.
func (f *Flags) Config(joinOnly bool) (fakedaemon.Config, error) {
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
	if t := cfg.SessionTransport; t != agent.SessionFramed && t != agent.SessionConnect {
		return cfg, fmt.Errorf("--session-transport must be %s or %s, got %q", agent.SessionFramed, agent.SessionConnect, t)
	}
	if cfg.JoinConcurrency < 1 || cfg.JoinConcurrency > agent.MaxNodes {
		return cfg, fmt.Errorf("--join-concurrency must be from 1 to %d, got %d", agent.MaxNodes, cfg.JoinConcurrency)
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
	cfg.Token = f.getenv(JoinTokenVar)
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
