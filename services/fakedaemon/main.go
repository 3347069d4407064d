// Command fakedaemon runs simulated GPU machines that join better-compute and
// hold a Session with the gateway, as the real daemon does, on fake hardware.
//
//	fakedaemon [flags]          join (machines that have not yet), then run the sessions
//	fakedaemon join [flags]     join the machines that have not yet, print their node ids, exit
//	fakedaemon healthcheck [URL]
//
// Flags (each with an environment variable that sets its default):
//
//	--server URL                 BC_SERVER               the deployment's API: its /.well-known/better-compute
//	                                                     gives the join URL, the gateway and the join keys
//	--pins-file PATH             BC_PINS_FILE            the deployment's pins.json (from `pki init`)
//	--serving-ca-pin PIN         BC_SERVING_CA_PIN       pins ("sha256/<base64>"), each overriding the pins file;
//	--join-signing-pin PIN       BC_JOIN_SIGNING_PIN     the first three are required to join
//	--join-encryption-pin PIN    BC_JOIN_ENCRYPTION_PIN
//	--command-signing-pin PIN    BC_COMMAND_SIGNING_PIN
//	--join-keys-dir DIR          BC_JOIN_KEYS_DIR        join-encryption.pub, join-signing.pub (and command-signing.pub, optional), without --server
//	--insecure-trust-server-pins BC_INSECURE_TRUST_SERVER_PINS  take the pins from the server's own document
//	                                                     (trust on first use; development only)
//	--join-url URL               BC_JOIN_URL             JoinService (the document's joinUrl with --server,
//	                                                     else http://joinservice:8081)
//	--token-file PATH            BC_JOIN_TOKEN_FILE      file holding the join token, waited for
//	                             BC_JOIN_TOKEN           the join token itself (wins over the file)
//	--token-wait DURATION        BC_JOIN_TOKEN_WAIT      how long to wait for the token file (2m)
//	--data-dir PATH              BC_DATA_DIR             identities and journals (/var/lib/fakedaemon)
//	--variant NAME               BC_VARIANT              hgx-h100, hgx-h100-gpu-missing, l40s, cpu (hgx-h100)
//	--nodes N                    BC_NODES                machines in this process, each in <data-dir>/<i> (1; at most 20,000)
//	--gateway-url URL[,URL…]     BC_GATEWAY_URL          overrides the JoinResponse's gateway URLs (one per
//	                                                     replica; a machine moves to the next when it loses one);
//	                                                     each https://HOST[:PORT], or the flag is an error
//	--gateway-server-name NAME   BC_GATEWAY_SERVER_NAME  overrides the TLS server name of the gateway
//	--gateway-silence-timeout D  BC_GATEWAY_SILENCE_TIMEOUT  how long a session may hear nothing from a gateway
//	                                                     that acknowledges heartbeats before the machine drops
//	                                                     it and moves on (0: 3 heartbeat intervals, at most 15s;
//	                                                     never below 1.5 intervals)
//	--health-listen ADDR         BC_HEALTH_LISTEN        /healthz server (:8085; --health-listen= for none)
//	--command-durations LIST     BC_COMMAND_DURATIONS    how long fake commands take: KIND=DURATION items,
//	                                                     comma-separated, e.g. diag.nvml=0,logs.collect=2s,default=1s
//	                                                     (see below; unset: the usual durations)
//
// In --command-durations, KIND is one of diag.nvml, inventory.refresh,
// logs.collect, node.reboot, and DURATION a Go duration ≥ 0 (a bare 0 is
// allowed). Kinds not listed keep their usual durations (diag.nvml 800ms,
// inventory.refresh 200ms, logs.collect 300ms, node.reboot 100ms), unless
// the list has default=DURATION: then every kind not listed takes that
// (and so does an unknown kind, which fails after it). An unknown kind, a
// kind given twice, a malformed item, or a bad or negative duration is an
// error naming the flag and the item.
//
// The token is only ever sent sealed to JoinService's key, and a machine
// trusts a JoinResponse only once it verified it against the pins: without
// pins it refuses to join. `fakedaemon healthcheck [URL]` probes
// http://127.0.0.1:8085/healthz, which answers 200 once every machine has
// joined. A refused Join (bad, expired, revoked or used-up token) or an
// untrusted JoinResponse exits with status 1 and the reason.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

func main() {
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "healthcheck" {
		url := "http://127.0.0.1:8085/healthz"
		if len(args) > 1 {
			url = args[1]
		}
		os.Exit(service.Healthcheck(url))
	}
	joinOnly := len(args) > 0 && args[0] == "join"
	if joinOnly {
		args = args[1:]
	}
	cfg, err := parseConfig(args, joinOnly)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakedaemon:", err)
		os.Exit(2)
	}
	if err := run(cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "fakedaemon:", err)
		os.Exit(1)
	}
}

// parseConfig reads flags whose defaults come from the environment; joinOnly
// is the `join` subcommand.
func parseConfig(args []string, joinOnly bool) (fakedaemon.Config, error) {
	var cfg fakedaemon.Config
	name := "fakedaemon"
	if joinOnly {
		name = "fakedaemon join"
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	tokenWait, err := service.EnvDuration("BC_JOIN_TOKEN_WAIT", agent.DefaultTokenWait)
	if err != nil {
		return cfg, err
	}
	silence, err := service.EnvDuration("BC_GATEWAY_SILENCE_TIMEOUT", 0)
	if err != nil {
		return cfg, err
	}
	nodes := 1
	if v := os.Getenv("BC_NODES"); v != "" {
		if nodes, err = strconv.Atoi(v); err != nil {
			return cfg, fmt.Errorf("BC_NODES: %w", err)
		}
	}
	insecure := false
	if v := os.Getenv("BC_INSECURE_TRUST_SERVER_PINS"); v != "" {
		if insecure, err = strconv.ParseBool(v); err != nil {
			return cfg, fmt.Errorf("BC_INSECURE_TRUST_SERVER_PINS: %w", err)
		}
	}
	var pinsFile, keysDir, durations string
	var pins pki.Pins
	fs.StringVar(&cfg.Server, "server", os.Getenv("BC_SERVER"), "the deployment's API base URL (its well-known document gives the join URL, gateway and keys)")
	fs.StringVar(&pinsFile, "pins-file", os.Getenv("BC_PINS_FILE"), "the deployment's pins.json")
	fs.StringVar(&pins.ServingCA, "serving-ca-pin", os.Getenv("BC_SERVING_CA_PIN"), "pin of the gateways' serving CA (sha256/<base64>)")
	fs.StringVar(&pins.JoinSigning, "join-signing-pin", os.Getenv("BC_JOIN_SIGNING_PIN"), "pin of JoinService's signing key")
	fs.StringVar(&pins.JoinEncryption, "join-encryption-pin", os.Getenv("BC_JOIN_ENCRYPTION_PIN"), "pin of JoinService's HPKE key")
	fs.StringVar(&pins.CommandSigning, "command-signing-pin", os.Getenv("BC_COMMAND_SIGNING_PIN"), "pin of the command-signing root (checked when given)")
	fs.StringVar(&keysDir, "join-keys-dir", os.Getenv("BC_JOIN_KEYS_DIR"), "directory holding join-encryption.pub and join-signing.pub (instead of --server)")
	fs.BoolVar(&cfg.InsecureTrustServerPins, "insecure-trust-server-pins", insecure, "INSECURE: take the pins from the server's own well-known document (trust on first use)")
	fs.StringVar(&cfg.JoinURL, "join-url", os.Getenv("BC_JOIN_URL"), "JoinService base URL (default: the well-known document's, else "+fakedaemon.DefaultJoinURL+")")
	fs.StringVar(&cfg.TokenFile, "token-file", os.Getenv("BC_JOIN_TOKEN_FILE"), "file holding the join token (waited for)")
	fs.DurationVar(&cfg.TokenWait, "token-wait", tokenWait, "how long to wait for the token file to appear")
	fs.StringVar(&cfg.DataDir, "data-dir", service.Env("BC_DATA_DIR", fakedaemon.DefaultDataDir), "directory of the machines' identities and journals")
	fs.StringVar(&cfg.Variant, "variant", service.Env("BC_VARIANT", fakedaemon.DefaultVariant), "fake hardware: hgx-h100, hgx-h100-gpu-missing, l40s or cpu")
	fs.IntVar(&cfg.Nodes, "nodes", nodes, "machines to run in this process")
	fs.StringVar(&cfg.GatewayURL, "gateway-url", os.Getenv("BC_GATEWAY_URL"), "override the gateway URLs of the JoinResponse (comma-separated, one per gateway replica; a machine moves to the next when it loses its session)")
	fs.StringVar(&cfg.GatewayServerName, "gateway-server-name", os.Getenv("BC_GATEWAY_SERVER_NAME"), "override the gateway's TLS server name")
	fs.DurationVar(&cfg.Core.SilenceTimeout, "gateway-silence-timeout", silence, "drop a session that heard nothing from its gateway (one that acknowledges heartbeats) for this long and reconnect (0: 3 heartbeat intervals, at most 15s; never below 1.5 intervals)")
	fs.StringVar(&cfg.HealthListen, "health-listen", service.Env("BC_HEALTH_LISTEN", fakedaemon.DefaultHealthListen), "address of the /healthz server (empty for none)")
	fs.StringVar(&durations, "command-durations", os.Getenv("BC_COMMAND_DURATIONS"), "how long fake commands take: KIND=DURATION,… (kinds "+strings.Join(fakehw.Kinds(), ", ")+", and default for every kind not listed); unset: the usual durations")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if durations != "" {
		d, err := parseCommandDurations(durations)
		if err != nil {
			return cfg, fmt.Errorf("--command-durations: %w", err)
		}
		cfg.Durations = &d
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected argument %q", fs.Arg(0))
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
	if pinsFile != "" {
		fromFile, err := pki.ReadPinsFile(pinsFile)
		if err != nil {
			return cfg, fmt.Errorf("--pins-file: %w", err)
		}
		cfg.Pins = fromFile
	}
	for _, p := range []struct{ flag, v string }{
		{"--serving-ca-pin", pins.ServingCA}, {"--join-signing-pin", pins.JoinSigning},
		{"--join-encryption-pin", pins.JoinEncryption}, {"--command-signing-pin", pins.CommandSigning},
	} {
		if p.v == "" {
			continue
		}
		if _, err := pki.ParsePin(p.v); err != nil {
			return cfg, fmt.Errorf("%s: %w", p.flag, err)
		}
	}
	cfg.Pins = mergePins(cfg.Pins, pins)
	if keysDir != "" {
		if cfg.JoinEncryptionKey, cfg.JoinSigningKey, err = pki.ReadJoinPublicKeys(keysDir); err != nil {
			return cfg, fmt.Errorf("--join-keys-dir: %w", err)
		}
		// Optional: with it, a command-signing pin is checked before Join.
		if _, cfg.CommandSigningKey, err = pki.LoadPublicKey(filepath.Join(keysDir, pki.CommandSigningPub)); err != nil {
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
	cfg.Token = os.Getenv("BC_JOIN_TOKEN")
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

// run runs the machines until a signal (or, joining only, until every
// machine has joined; then it prints one line per machine to out).
func run(cfg fakedaemon.Config, out io.Writer) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger, shutdown, err := telemetry.Setup(ctx, "fakedaemon")
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdown(sctx)
	}()
	r, err := fakedaemon.New(cfg, agent.Deps{Logger: logger})
	if err != nil {
		return err
	}
	err = r.Run(ctx)
	if !cfg.JoinOnly {
		return err
	}
	return joinReport(r, err, out)
}

// joinReport prints one line per machine of a `join` run (the id of each
// that joined, the refusal of each that was refused) and returns err, or
// why not every machine joined: the command exits non-zero if any machine
// was refused.
func joinReport(r *agent.Runner, err error, out io.Writer) error {
	var refused *agent.JoinRefusedError
	if err != nil && !errors.As(err, &refused) {
		return err
	}
	for _, m := range r.Machines() {
		st := m.Status()
		switch {
		case st.Joined:
			fmt.Fprintf(out, "machine %d joined as %s (%s)\n", st.Index, st.NodeID, m.Dir())
		case st.JoinError != "":
			fmt.Fprintf(out, "machine %d refused: %s\n", st.Index, st.JoinError)
		}
	}
	if err != nil {
		return err
	}
	return r.Ready() // nil, or interrupted before every machine joined
}
