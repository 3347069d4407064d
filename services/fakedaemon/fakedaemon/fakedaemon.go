// Package fakedaemon runs simulated GPU machines: the node agent (pkg/agent)
// on fake hardware (pkg/fakehw). Everything a real machine's daemon does —
// joining, the identity and journal on disk, the Session with the gateway,
// certificate renewal — is pkg/agent's; this package says which fake
// machine each one is (variant, machine id, how long its commands take).
//
// To run N fake machines of a variant in-process (tests, `better-compute
// dev --sim N`), call Start (or New and Run) with Config.Nodes and
// Config.Variant, and read the handles from Runner.Machines. To add a fake
// hardware option, add it to Config and apply it in Hardware.New.
package fakedaemon

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/service"
)

// Version is the agent version fakedaemon reports in the Join claims and in
// Hello.
const Version = "fakedaemon/0.1.0"

// Defaults of Config.
const (
	// DefaultJoinURL is JoinService's URL when neither Server nor JoinURL
	// is given (compose's service name).
	DefaultJoinURL = "http://joinservice:8081"
	// DefaultDataDir is where the machines live when DataDir is empty.
	DefaultDataDir = "/var/lib/fakedaemon"
	// DefaultVariant is the fake hardware of a machine that has not joined
	// when Variant is empty.
	DefaultVariant = fakehw.VariantHGXH100
	// DefaultHealthListen is the fakedaemon command's /healthz address
	// (--health-listen; agent.Config.HealthListen).
	DefaultHealthListen = ":8085"
)

// Config configures the fake machines of a Runner: the agent's
// configuration and the fake hardware. Zero fields take the defaults named
// (the agent's as agent.Config says; JoinURL, DataDir and AgentVersion
// those of this package).
type Config struct {
	// Config is the agent's configuration (server, pins, token, data
	// directory, node count, the daemon core's timings, …).
	agent.Config
	// Variant is the fakehw variant of machines that have not joined yet
	// (default hgx-h100); a joined machine keeps the variant it joined with.
	Variant string
	// Durations, when set, replaces how long fake commands take
	// (fakehw.DefaultDurations otherwise).
	Durations *fakehw.Durations
	// MachineIDSeed, when set, derives each machine's id from it and the
	// machine's index (MachineID), so the same seed gives the same hardware
	// (GPU UUIDs, hostnames, boot ids) run after run; empty: a random id
	// for each machine that has not begun joining.
	MachineIDSeed string
	// Profiling, with PprofListen set, serves the process's Go runtime
	// profiles there, as a service's BETTER_COMPUTE_PPROF_LISTEN does
	// (service.Profiling): the benchmarks profile the machines' process
	// beside the control plane's.
	service.Profiling
}

// hardware is the Runner's agent.HardwareFunc: the fake machine spec
// describes. Its machine id is the one it joined (or began joining) with,
// else one of MachineIDSeed or a random one; its variant the one it joined
// with (with a warning when Variant asks for another), else Variant; it is
// at boot spec.Boot, its commands taking Durations. It fails for an unknown
// variant, naming the valid ones.
func (c Config) hardware(spec agent.HardwareSpec) (agent.Hardware, error) {
	variant := c.variant()
	if spec.Variant != "" {
		if spec.Variant != variant && spec.Logger != nil {
			spec.Logger.Warn("keeping the variant the machine joined with", "variant", spec.Variant, "requested", variant)
		}
		variant = spec.Variant
	}
	machineID := spec.MachineID
	switch {
	case machineID != "":
	case c.MachineIDSeed != "":
		machineID = MachineID(c.MachineIDSeed, spec.Index)
	default:
		var raw [16]byte
		if _, err := rand.Read(raw[:]); err != nil {
			return nil, fmt.Errorf("machine id: %w", err)
		}
		machineID = hex.EncodeToString(raw[:])
	}
	hw, err := fakehw.New(variant, machineID)
	if err != nil {
		return nil, err
	}
	if c.Durations != nil {
		hw.SetDurations(*c.Durations)
	}
	hw.SetBoot(spec.Boot)
	return hw, nil
}

// variant returns Variant, or DefaultVariant when it is empty.
func (c Config) variant() string {
	if c.Variant == "" {
		return DefaultVariant
	}
	return c.Variant
}

// MachineID returns the machine id of machine index under seed
// (Config.MachineIDSeed): 32 hex characters of SHA-256(seed, index), the
// shape of a random one.
func MachineID(seed string, index int) string {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s/%d", seed, index))
	return hex.EncodeToString(sum[:16])
}

// New returns an agent.Runner of cfg.Nodes fake machines (deps.Hardware is
// replaced by cfg's fake hardware). It fails as agent.New does, and for an unknown variant
// (naming the valid ones).
func New(cfg Config, deps agent.Deps) (*agent.Runner, error) {
	if _, err := fakehw.New(cfg.variant(), "check"); err != nil {
		return nil, err
	}
	if cfg.JoinURL == "" && cfg.Server == "" {
		cfg.JoinURL = DefaultJoinURL
	}
	if cfg.DataDir == "" {
		cfg.DataDir = DefaultDataDir
	}
	if cfg.AgentVersion == "" {
		cfg.AgentVersion = Version
	}
	deps.Hardware = cfg.hardware
	return agent.New(cfg.Config, deps)
}

// Start makes a Runner with New and runs it in the background until ctx
// ends or a machine fails (a refused Join); Runner.Wait returns the outcome.
func Start(ctx context.Context, cfg Config, deps agent.Deps) (*agent.Runner, error) {
	r, err := New(cfg, deps)
	if err != nil {
		return nil, err
	}
	go func() { _ = r.Run(ctx) }()
	return r, nil
}
