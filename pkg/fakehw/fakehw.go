// Package fakehw simulates the hardware of a GPU machine for the fakedaemon,
// the fleet simulator and tests: a fixed board per variant, stable GPU UUIDs
// derived from the machine id, a boot counter whose boot ids are derived from
// the machine id too, and the effects of the daemon's commands (diag.nvml,
// inventory.refresh, logs.collect, node.reboot) together with how long each
// takes in simulated time, and the echo shell that the agent runs on shell
// tunnels and SSH sessions (Shell, shell.go).
//
// Nothing here reads the clock, the environment or a global random source, so
// the same machine id and boot number always give the same answers.
//
// To add a variant, add an entry to the variants table (and a row to the
// table test); to add a command kind, add a case to Run, a duration to
// DefaultDurations and the kind to Kinds.
package fakehw

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// Command kinds the fake hardware runs (docs/architecture.md, "Commands").
const (
	KindDiagNVML         = "diag.nvml"
	KindInventoryRefresh = "inventory.refresh"
	KindLogsCollect      = "logs.collect"
	KindNodeReboot       = "node.reboot"
)

// Kinds returns the command kinds Run knows, sorted: diag.nvml,
// inventory.refresh, logs.collect, node.reboot.
func Kinds() []string {
	return []string{KindDiagNVML, KindInventoryRefresh, KindLogsCollect, KindNodeReboot}
}

// Variant names.
const (
	VariantHGXH100           = "hgx-h100"
	VariantHGXH100GPUMissing = "hgx-h100-gpu-missing"
	VariantL40S              = "l40s"
	VariantCPU               = "cpu"
)

const gib = int64(1) << 30

// board describes one variant's hardware.
type board struct {
	model       string
	gpuMemory   int64    // bytes per GPU
	busIDs      []string // one PCI bus id per GPU slot, in index order
	missing     []int32  // GPU indexes absent from the board
	cpuCores    int32
	memoryBytes int64
	driver      string
}

var variants = map[string]board{
	VariantHGXH100: {
		model:     "NVIDIA H100 80GB HBM3",
		gpuMemory: 80 * gib,
		busIDs:    []string{"18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"},
		cpuCores:  224, memoryBytes: 2048 * gib, driver: "550.90.07",
	},
	VariantHGXH100GPUMissing: {
		model:     "NVIDIA H100 80GB HBM3",
		gpuMemory: 80 * gib,
		busIDs:    []string{"18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"},
		missing:   []int32{3},
		cpuCores:  224, memoryBytes: 2048 * gib, driver: "550.90.07",
	},
	VariantL40S: {
		model:     "NVIDIA L40S",
		gpuMemory: 48 * gib,
		busIDs:    []string{"17", "31", "B1", "CA"},
		cpuCores:  64, memoryBytes: 512 * gib, driver: "550.90.07",
	},
	VariantCPU: {
		cpuCores: 32, memoryBytes: 128 * gib,
	},
}

// Variants returns the names of the known variants, sorted.
func Variants() []string {
	out := make([]string, 0, len(variants))
	for v := range variants {
		out = append(out, v)
	}
	slices.Sort(out)
	return out
}

// Durations says how long each command kind takes in simulated time. Kinds
// missing from the map take Default.
type Durations struct {
	// ByKind maps a command kind to its duration.
	ByKind map[string]time.Duration
	// Default is the duration of kinds not in ByKind (unknown kinds fail
	// after it).
	Default time.Duration
}

// DefaultDurations are the command durations of a new Machine: short enough
// for real-time tests, long enough that a command is seen RUNNING.
func DefaultDurations() Durations {
	return Durations{
		ByKind: map[string]time.Duration{
			KindDiagNVML:         800 * time.Millisecond,
			KindInventoryRefresh: 200 * time.Millisecond,
			KindLogsCollect:      300 * time.Millisecond,
			KindNodeReboot:       100 * time.Millisecond,
		},
		Default: 50 * time.Millisecond,
	}
}

// Machine is one fake GPU machine. It is not safe for concurrent use: its
// owner (one daemon core) calls it from one goroutine; only Shell may run
// on other goroutines meanwhile.
type Machine struct {
	variant   string
	machineID string
	hostname  string
	b         *board
	gpus      []gpu
	boot      uint64
	bootID    string
	durations Durations
}

type gpu struct {
	index int32
	uuid  string
	busID string
}

// New returns the machine of variant with the given machine id (any
// non-empty string, e.g. the contents of /etc/machine-id), at boot 0. It
// fails for an unknown variant, naming the valid ones, and for an empty
// machine id.
func New(variant, machineID string) (*Machine, error) {
	b, ok := variants[variant]
	if !ok {
		return nil, fmt.Errorf("unknown hardware variant %q (valid: %s)", variant, strings.Join(Variants(), ", "))
	}
	if machineID == "" {
		return nil, errors.New("machine id must not be empty")
	}
	m := &Machine{
		variant:   variant,
		machineID: machineID,
		hostname:  variant + "-" + shortID(machineID),
		b:         &b,
		durations: DefaultDurations(),
	}
	for i, bus := range b.busIDs {
		idx := int32(i)
		if slices.Contains(b.missing, idx) {
			continue
		}
		m.gpus = append(m.gpus, gpu{index: idx, uuid: GPUUUID(machineID, idx), busID: "00000000:" + bus + ":00.0"})
	}
	m.SetBoot(0)
	return m, nil
}

// shortID returns the first 8 hex characters of SHA-256(machineID), a stable
// short name for hostnames.
func shortID(machineID string) string {
	sum := sha256.Sum256([]byte(machineID))
	return hex.EncodeToString(sum[:4])
}

// GPUUUID returns the UUID of GPU index on machineID: "GPU-" and a UUID made
// of the first 16 bytes of SHA-256(machineID, 0x00, decimal index).
func GPUUUID(machineID string, index int32) string {
	return "GPU-" + uuidOf(machineID, "gpu", strconv.Itoa(int(index)))
}

// uuidOf formats the first 16 bytes of SHA-256 over parts (NUL separated) as
// a lower-case 8-4-4-4-12 UUID.
func uuidOf(parts ...string) string {
	h := sha256.New()
	for i, p := range parts {
		if i > 0 {
			h.Write([]byte{0})
		}
		h.Write([]byte(p))
	}
	s := hex.EncodeToString(h.Sum(nil)[:16])
	return s[0:8] + "-" + s[8:12] + "-" + s[12:16] + "-" + s[16:20] + "-" + s[20:32]
}

// Variant returns the machine's variant name.
func (m *Machine) Variant() string { return m.variant }

// MachineID returns the machine id it was made with.
func (m *Machine) MachineID() string { return m.machineID }

// Hostname returns "<variant>-<8 hex of SHA-256(machine id)>".
func (m *Machine) Hostname() string { return m.hostname }

// Boot returns the boot number (0 for the first boot).
func (m *Machine) Boot() uint64 { return m.boot }

// SetBoot sets the boot number, e.g. from a counter kept on disk, and with it
// the boot id.
func (m *Machine) SetBoot(n uint64) {
	m.boot = n
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], n)
	m.bootID = uuidOf(m.machineID, "boot", hex.EncodeToString(b[:]))
}

// BootID returns the id of the current boot: a UUID derived from the machine
// id and the boot number, so it changes on every Reboot.
func (m *Machine) BootID() string { return m.bootID }

// Reboot simulates a reboot: the boot number goes up by one and the boot id
// changes. It returns the new boot id.
func (m *Machine) Reboot() string {
	m.SetBoot(m.boot + 1)
	return m.bootID
}

// SetDurations replaces how long commands take.
func (m *Machine) SetDurations(d Durations) { m.durations = d }

// Duration returns how long a command of kind takes in simulated time.
func (m *Machine) Duration(kind string) time.Duration {
	if d, ok := m.durations.ByKind[kind]; ok {
		return d
	}
	return m.durations.Default
}

// GPUCount returns how many GPUs the board has.
func (m *Machine) GPUCount() int { return len(m.gpus) }

// HasGPU reports whether the board has a GPU with index.
func (m *Machine) HasGPU(index int32) bool {
	for _, g := range m.gpus {
		if g.index == index {
			return true
		}
	}
	return false
}

// Inventory returns what NVML and the OS report: hostname, CPU cores,
// memory in bytes, driver version ("" without GPUs) and the GPUs in index
// order, all healthy. Each call returns a new message.
func (m *Machine) Inventory() *gatewayv1.Inventory {
	inv := &gatewayv1.Inventory{
		Hostname:      m.hostname,
		CpuCores:      m.b.cpuCores,
		MemoryBytes:   m.b.memoryBytes,
		DriverVersion: m.b.driver,
		Gpus:          make([]*gatewayv1.Gpu, 0, len(m.gpus)),
	}
	for _, g := range m.gpus {
		inv.Gpus = append(inv.Gpus, &gatewayv1.Gpu{
			Index:       g.index,
			Uuid:        g.uuid,
			Model:       m.b.model,
			MemoryBytes: m.b.gpuMemory,
			PciBusId:    g.busID,
			Healthy:     true,
		})
	}
	return inv
}

// Run performs the hardware side of a command of kind with its JSON
// arguments (nil or an object) and returns its result and how long it takes
// in simulated time:
//   - diag.nvml and inventory.refresh: the Inventory;
//   - logs.collect: text output, optional argument {"lines": n} (1..1000,
//     default 20);
//   - node.reboot: an output line; the caller reboots the machine (Reboot)
//     once it has reported success.
//
// It fails for an unknown kind or malformed arguments; the duration is then
// still how long the failure takes.
func (m *Machine) Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error) {
	d := m.Duration(kind)
	switch kind {
	case KindDiagNVML, KindInventoryRefresh:
		return &gatewayv1.CommandResult{Inventory: m.Inventory()}, d, nil
	case KindLogsCollect:
		var a struct {
			Lines *int `json:"lines"`
		}
		if len(args) > 0 {
			if err := json.Unmarshal(args, &a); err != nil {
				return nil, d, fmt.Errorf("logs.collect: args must be a JSON object: %w", err)
			}
		}
		n := 20
		if a.Lines != nil {
			n = *a.Lines
			if n < 1 || n > 1000 {
				return nil, d, fmt.Errorf("logs.collect: lines must be between 1 and 1000, got %d", n)
			}
		}
		return &gatewayv1.CommandResult{Output: m.logs(n)}, d, nil
	case KindNodeReboot:
		return &gatewayv1.CommandResult{Output: "rebooting " + m.hostname + "\n"}, d, nil
	default:
		return nil, d, fmt.Errorf("unknown command kind %q", kind)
	}
}

// logs returns n deterministic journal-like lines about this boot.
func (m *Machine) logs(n int) string {
	var sb strings.Builder
	msgs := []string{
		"kernel: Linux version 6.8.0-fake (fakehw)",
		fmt.Sprintf("systemd[1]: Hostname set to <%s>.", m.hostname),
		fmt.Sprintf("nvidia-persistenced: driver %s, %d GPU(s)", orNone(m.b.driver), len(m.gpus)),
		"fakedaemon: session healthy",
	}
	for i := range n {
		fmt.Fprintf(&sb, "boot=%s seq=%d %s\n", m.bootID[:8], i, msgs[i%len(msgs)])
	}
	return sb.String()
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}
