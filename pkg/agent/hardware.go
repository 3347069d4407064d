package agent

import (
	"context"
	"log/slog"
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// Hardware is one machine as the agent sees it: everything machine-specific
// the agent and its daemon core (pkg/daemon) ask of it. The fakedaemon's is
// pkg/fakehw's Machine (services/fakedaemon); a real daemon's reads the host
// and NVML. The agent calls a machine's Hardware from one goroutine (the
// machine's loop), never concurrently, except Shell: each shell runs on a
// goroutine of its own, concurrently with the loop's calls and with other
// shells.
//
// Allocations are not the Hardware's: the daemon core binds them itself,
// reporting the CDI device names "nvidia.com/gpu=<index>" (daemon.CDIName)
// of the GPU indexes in the NodeSpec, which a container runtime with the
// NVIDIA CDI specification resolves on the host.
type Hardware interface {
	// MachineID returns the machine's stable id, sent in the Join claims
	// and kept in the identity: the same on every start of the machine
	// (e.g. /etc/machine-id). When HardwareSpec.MachineID is set, the
	// machine joined (or began joining) with that id; hardware that knows
	// its own id may refuse a different one (the data directory is another
	// machine's).
	MachineID() string
	// Hostname returns the machine's host name, sent in the Join claims and
	// as the common name of every CSR (Join and certificate renewal).
	Hostname() string
	// Variant returns the machine's hardware model as the Join claims name
	// it (e.g. "hgx-h100"; free text for the control plane, which decides
	// acceptance from the inventory, not from this).
	Variant() string
	// BootID returns the id of the current boot, sent in Hello: it must
	// change when, and only when, the machine reboots (on Linux,
	// /proc/sys/kernel/random/boot_id).
	BootID() string
	// Run performs the command kind with its JSON arguments (nil or an
	// object) and returns its result, how long it takes (the daemon core
	// reports completion that much later; 0 for a command that is done when
	// Run returns) and an error if it failed (reported as the command's
	// error). Kinds (docs/architecture.md, "Commands"): diag.nvml and
	// inventory.refresh return the Inventory (hostname, CPU cores, memory in
	// bytes, driver version, every GPU with its index, UUID, model, memory
	// and PCI bus id, from NVML); logs.collect returns recent log lines as
	// Output (argument {"lines": n}); node.reboot returns an Output line and
	// must not reboot yet: the core calls Reboot once it reported success.
	// An unknown kind is an error.
	Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error)
	// Reboot reboots the machine and returns the new boot id. After
	// node.reboot succeeded (every command before it finished, its
	// SUCCEEDED sent), the daemon core closes the session, waits
	// daemon.Config.RebootDowntime, calls Reboot and dials again:
	// simulated hardware only changes its boot id; on a real machine the
	// agent's process ends with the reboot, and its next start is the new
	// boot.
	Reboot() string
	// Shell runs the machine's shell on term for a tunnel
	// (docs/architecture.md, "Tunnels") and returns its exit status (0 to
	// 255). With command "" it is an interactive shell (a shell tunnel, or
	// an SSH session's shell request), which runs until it exits or its
	// input ends; otherwise it runs that one command line (an SSH exec)
	// and returns its status. term's size is the client's (zero for an
	// SSH exec without a pty) and follows its resizes; its input is raw:
	// the shell echoes and edits lines itself.
	//
	// Each call runs on a goroutine of its own, one per shell tunnel or
	// SSH session, concurrently with the machine's loop (which goes on
	// calling the other methods) and with other shells: Shell must be safe
	// for that. ctx ends when the tunnel does (the client left, the
	// machine stops or reboots, an SSH login lost its right); term's input
	// then returns an error, and Shell must return promptly. The agent
	// sends the status as the shell tunnel's exit frame, or as the SSH
	// session's exit-status. pkg/fakehw's Machine runs its echo shell.
	Shell(ctx context.Context, term tunnel.Terminal, command string) int
}

// Hardware is what the daemon core drives.
var _ daemon.Hardware = Hardware(nil)

// HardwareSpec is what the agent knows of a machine when it starts it: what
// the machine's directory says about the machine that joined from it.
type HardwareSpec struct {
	// Index is the machine's index in the Runner (its directory,
	// Config.DataDir/<index>).
	Index int
	// MachineID is the machine id the machine joined, or began joining,
	// with (its identity's or join.pending's); "" on its first start, when
	// the hardware says which it is.
	MachineID string
	// Variant is the hardware variant the machine joined with; "" before
	// it joined.
	Variant string
	// Boot is the number of this boot as the agent counts them (BootFile):
	// 0 for the start that joins and for a start that only joins; else one
	// more than the last boot recorded, a start's or a reboot's (the agent
	// records each Reboot). Simulated hardware derives its boot id from it;
	// hardware whose boot id comes from the machine ignores it.
	Boot uint64
	// Logger is the machine's logger.
	Logger *slog.Logger
}

// HardwareFunc returns the Hardware of one machine (Deps.Hardware): it is
// called at each start of each machine of a Runner, from that machine's
// goroutine, before the machine joins. An error stops the Runner.
type HardwareFunc func(spec HardwareSpec) (Hardware, error)
