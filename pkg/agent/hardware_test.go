package agent_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

// testVersion is the agent version of the tests' Runners.
const testVersion = "agent-test/0.1.0"

// fakeHardware is a Deps.Hardware of fakehw machines of variant (hgx-h100
// when empty) whose commands take durations (fakehw's when nil), as
// services/fakedaemon makes them: a machine that joined keeps the variant
// and machine id it joined with, a new one gets a random id.
func fakeHardware(variant string, durations *fakehw.Durations) agent.HardwareFunc {
	return func(spec agent.HardwareSpec) (agent.Hardware, error) {
		v, id := variant, spec.MachineID
		if v == "" {
			v = fakehw.VariantHGXH100
		}
		if spec.Variant != "" {
			v = spec.Variant
		}
		if id == "" {
			var raw [16]byte
			_, _ = rand.Read(raw[:])
			id = hex.EncodeToString(raw[:])
		}
		hw, err := fakehw.New(v, id)
		if err != nil {
			return nil, err
		}
		if durations != nil {
			hw.SetDurations(*durations)
		}
		hw.SetBoot(spec.Boot)
		return hw, nil
	}
}

// withHardware returns deps with fakeHardware("", nil) unless it names its
// hardware.
func withHardware(deps agent.Deps) agent.Deps {
	if deps.Hardware == nil {
		deps.Hardware = fakeHardware("", nil)
	}
	return deps
}

// newRunner is agent.New with withHardware(deps).
func newRunner(cfg agent.Config, deps agent.Deps) (*agent.Runner, error) {
	return agent.New(cfg, withHardware(deps))
}

// startRunner is agent.Start with withHardware(deps).
func startRunner(ctx context.Context, cfg agent.Config, deps agent.Deps) (*agent.Runner, error) {
	return agent.Start(ctx, cfg, withHardware(deps))
}
