package inprocess_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

// cutProxy forwards TCP connections to a target; Cut drops every connection
// open at the time, as a network failure does, while new ones go through.
type cutProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  map[net.Conn]bool
	wg     sync.WaitGroup
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.Cut()
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[up] = true, true
		p.mu.Unlock()
		p.wg.Add(2)
		pipe := func(dst, src net.Conn) {
			defer p.wg.Done()
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
			p.mu.Lock()
			delete(p.conns, dst)
			delete(p.conns, src)
			p.mu.Unlock()
		}
		go pipe(up, c)
		go pipe(c, up)
	}
}

// Cut closes every open connection.
func (p *cutProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// URL is the proxy's https:// URL.
func (p *cutProxy) URL() string { return "https://" + p.ln.Addr().String() }

// commandFixture is a stack with one adopted machine whose session goes
// through a cutProxy.
type commandFixture struct {
	*fixture
	proxy    *cutProxy
	commands computev1connect.CommandServiceClient
	token    string // the machine's join token
	dataDir  string
	runner   *agent.Runner
	stop     func()
	nodeID   string
}

// machineConfig is the fakedaemon configuration of the fixture's machine:
// node.reboot and logs.collect take long, reconnects and reboots are quick.
func (f *commandFixture) machineConfig(d fakehw.Durations) fakedaemon.Config {
	return fakedaemon.Config{
		Config: agent.Config{
			Server:     f.stack.APIURL,
			Pins:       f.stack.Pins,
			Token:      f.token,
			DataDir:    f.dataDir,
			Nodes:      1,
			GatewayURL: f.proxy.URL(),
			Core:       daemon.Config{BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, RebootDowntime: time.Second},
		},
		Variant:   fakehw.VariantHGXH100,
		Durations: &d,
	}
}

func (f *commandFixture) start(t *testing.T, d fakehw.Durations) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r, err := fakedaemon.Start(ctx, f.machineConfig(d), agent.Deps{})
	require.NoError(t, err)
	var once sync.Once
	f.runner = r
	f.stop = func() {
		once.Do(func() {
			cancel()
			_ = r.Wait()
		})
	}
	t.Cleanup(f.stop)
}

func setupCommands(t *testing.T, d fakehw.Durations) (*commandFixture, *agent.Machine) {
	t.Helper()
	base := setupWith(t, devstack.Options{ResyncInterval: time.Second})
	f := &commandFixture{fixture: base, proxy: newCutProxy(t, strings.TrimPrefix(base.stack.GatewayURLs[0], "https://")),
		commands: computev1connect.NewCommandServiceClient(http.DefaultClient, base.stack.APIURL+"/api/compute", base.stack.ClientOptions()...),
		token:    base.joinToken(t), dataDir: t.TempDir()}
	f.start(t, d)
	m := f.runner.Machines()[0]
	require.Eventually(t, func() bool {
		nodes, err := f.listNodes(t.Context())
		if err != nil || len(nodes) != 1 || nodes[0].GetProvisionState() != "adopted" || m.Status().SessionID == "" {
			return false
		}
		f.nodeID = nodes[0].GetId()
		return true
	}, 60*time.Second, 100*time.Millisecond, "the machine is adopted")
	return f, m
}

func (f *commandFixture) run(t *testing.T, kind string, timeout time.Duration) *computev1.Command {
	t.Helper()
	msg := &computev1.RunCommandRequest{NodeId: f.nodeID, Kind: kind}
	if timeout > 0 {
		msg.Timeout = durationpb.New(timeout)
	}
	res, err := f.commands.RunCommand(t.Context(), connect.NewRequest(msg))
	require.NoError(t, err)
	return res.Msg.GetCommand()
}

func (f *commandFixture) get(t *testing.T, id string) *computev1.Command {
	t.Helper()
	res, err := f.commands.GetCommand(t.Context(), connect.NewRequest(&computev1.GetCommandRequest{CommandId: id}))
	require.NoError(t, err)
	return res.Msg.GetCommand()
}

// waitState waits until command id is in state and returns it.
func (f *commandFixture) waitState(t *testing.T, id, state string, within time.Duration) *computev1.Command {
	t.Helper()
	var c *computev1.Command
	require.Eventually(t, func() bool {
		c = f.get(t, id)
		return c.GetState() == state
	}, within, 50*time.Millisecond, "command %s reaches %s: %v", id, state, &c)
	return c
}

func (f *commandFixture) events(t *testing.T, cmdID string) []string {
	t.Helper()
	rows, err := f.stack.DB.Pool.Query(t.Context(), `SELECT type FROM events WHERE subject_id = $1 ORDER BY id`, cmdID)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// bootID is the boot id the machine has after boot number n.
func bootID(t *testing.T, m *agent.Machine, n uint64) string {
	t.Helper()
	hw, err := fakehw.New(m.Status().Variant, m.Status().MachineID)
	require.NoError(t, err)
	hw.SetBoot(n)
	return hw.BootID()
}

// TestRebootRunsOnceAcrossADroppedStream runs node.reboot (not retry-safe)
// through the API and drops the session's connection while it runs: the
// gateway delivers it again on the new session, the daemon answers from its
// journal instead of running it again, and the command succeeds once. The
// reboot drops the session and the machine comes back on a new one with
// the next boot id, once: a second run would have rebooted it twice.
func TestRebootRunsOnceAcrossADroppedStream(t *testing.T) {
	d := fakehw.DefaultDurations()
	d.ByKind[fakehw.KindNodeReboot] = 3 * time.Second
	f, m := setupCommands(t, d)
	ctx := t.Context()
	boot0 := m.Status().BootID
	require.Equal(t, bootID(t, m, 0), boot0)

	c := f.run(t, "node.reboot", time.Minute)
	require.False(t, c.GetRetrySafe())
	f.waitState(t, c.GetId(), "running", 10*time.Second)
	session := m.Status().SessionID
	f.proxy.Cut()
	require.Eventually(t, func() bool {
		s := m.Status()
		return s.State == daemon.StateEstablished && s.SessionID != "" && s.SessionID != session
	}, 10*time.Second, 20*time.Millisecond, "the machine reconnects while the reboot runs")
	require.Equal(t, boot0, m.Status().BootID, "no reboot yet")

	done := f.waitState(t, c.GetId(), "succeeded", 20*time.Second)
	require.GreaterOrEqual(t, done.GetDeliveries(), int32(2), "the command was delivered again after the drop")
	require.Contains(t, done.GetResultJson(), "rebooting")

	boot1 := bootID(t, m, 1)
	require.Eventually(t, func() bool {
		s := m.Status()
		return s.BootID == boot1 && s.State == daemon.StateEstablished && s.SessionID != ""
	}, 15*time.Second, 20*time.Millisecond, "back with the next boot id")
	var dbBoot string
	require.Eventually(t, func() bool {
		return f.stack.DB.Pool.QueryRow(ctx, `SELECT boot_id FROM nodes WHERE id = $1`, f.nodeID).Scan(&dbBoot) == nil &&
			dbBoot == boot1
	}, 10*time.Second, 50*time.Millisecond, "the node's boot id is the new one: %s", &dbBoot)
	require.Never(t, func() bool { return m.Status().BootID != boot1 }, 3*time.Second, 50*time.Millisecond,
		"the machine rebooted a second time")
	require.Equal(t, "succeeded", f.get(t, c.GetId()).GetState())
	require.Equal(t, []string{"command.queued", "command.succeeded"}, f.events(t, c.GetId()))
}

// TestJournalWipedMidCommand stops the machine while a logs.collect
// (retry-safe) and a node.reboot (not retry-safe, queued after it, so
// waiting for it) run, deletes its journal and starts it again: the gateway
// delivers both again, the daemon runs the logs.collect again and fails the
// reboot without running it (it may have run before the loss). A command queued while the machine is down expires
// at its deadline (controllers) and is never delivered.
func TestJournalWipedMidCommand(t *testing.T) {
	d := fakehw.DefaultDurations()
	d.ByKind[fakehw.KindNodeReboot] = time.Minute
	d.ByKind[fakehw.KindLogsCollect] = time.Minute
	f, _ := setupCommands(t, d)
	ctx := t.Context()
	logs := f.run(t, "logs.collect", 5*time.Minute)
	reboot := f.run(t, "node.reboot", 5*time.Minute)
	require.True(t, logs.GetRetrySafe())
	f.waitState(t, reboot.GetId(), "running", 10*time.Second)
	f.waitState(t, logs.GetId(), "running", 10*time.Second)

	f.stop()
	journal := filepath.Join(f.dataDir, "0", agent.JournalFile)
	_, err := os.Stat(journal)
	require.NoError(t, err, "the journal is where the test deletes it")
	require.NoError(t, os.Remove(journal))

	// While the machine is down, a command with a short deadline expires.
	late := f.run(t, "diag.nvml", time.Second)
	expired := f.waitState(t, late.GetId(), "expired", 15*time.Second)
	require.NotNil(t, expired.GetFinishedAt())
	require.Zero(t, expired.GetDeliveries())
	require.Equal(t, []string{"command.queued", "command.expired"}, f.events(t, late.GetId()))

	d.ByKind[fakehw.KindNodeReboot] = 100 * time.Millisecond
	d.ByKind[fakehw.KindLogsCollect] = 100 * time.Millisecond
	f.start(t, d)
	m := f.runner.Machines()[0]
	failed := f.waitState(t, reboot.GetId(), "failed", 30*time.Second)
	require.Equal(t, daemon.ErrTextJournalLost, failed.GetError())
	require.GreaterOrEqual(t, failed.GetDeliveries(), int32(2))
	replayed := f.waitState(t, logs.GetId(), "succeeded", 30*time.Second)
	require.GreaterOrEqual(t, replayed.GetDeliveries(), int32(2))
	require.NotEmpty(t, replayed.GetResultJson())

	// The restart is boot 1 (the fakedaemon counts starts); the failed
	// reboot did not reboot it again.
	boot1 := bootID(t, m, 1)
	require.Eventually(t, func() bool { return m.Status().BootID == boot1 && m.Status().SessionID != "" },
		10*time.Second, 20*time.Millisecond)
	require.Never(t, func() bool { return m.Status().BootID != boot1 }, 2*time.Second, 50*time.Millisecond,
		"the machine ran the reboot after losing its journal")
	var state string
	require.NoError(t, f.stack.DB.Pool.QueryRow(ctx, `SELECT state FROM commands WHERE id = $1`, late.GetId()).Scan(&state))
	require.Equal(t, "expired", state, "an expired command is not delivered when the machine is back")
	require.Equal(t, []string{"command.queued", "command.failed"}, f.events(t, reboot.GetId()))
	require.Equal(t, []string{"command.queued", "command.succeeded"}, f.events(t, logs.GetId()))
}
