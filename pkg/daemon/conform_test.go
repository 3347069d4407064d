package daemon_test

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"buf.build/go/protovalidate"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/ids"
)

// TestAgentSendsWhatTheGatewayAccepts: text the daemon does not control
// (a command's error and output, an SSH client's user name, a hostname the
// hardware reports) is sent fitted to gateway.proto's rules, so that the
// gateway, which ends a session whose message breaks them, never refuses
// the daemon's own reports (a command update the daemon answers from its
// journal at every redelivery would otherwise end every session until the
// command's deadline). Text within the rules is sent as it is.
func TestAgentSendsWhatTheGatewayAccepts(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	long := strings.Repeat("é", 5000)
	h.hw.run = func(kind string, _ []byte) (*gatewayv1.CommandResult, time.Duration, error) {
		switch kind {
		case "logs.collect":
			return &gatewayv1.CommandResult{Output: "ok\tline\n\x1b[31mred\x1b[0m\n" + strings.Repeat("x", 300<<10)}, 0, nil
		case "inventory.refresh":
			return &gatewayv1.CommandResult{Inventory: &gatewayv1.Inventory{Hostname: "gpu_01", DriverVersion: "550.54\n",
				Gpus: []*gatewayv1.Gpu{{Uuid: "GPU-1 2", Model: "NVIDIA H100 80GB HBM3"}}}}, 0, nil
		}
		return nil, 0, errors.New("nvml: failed\nlevel=INFO msg=forged\x00 " + long)
	}
	h.establish()
	h.take()
	run := func(kind string) *gatewayv1.CommandUpdate {
		t.Helper()
		id := ids.New(ids.Command, h.now)
		h.receive(cmd(id, kind, h.now.Add(time.Minute), true))
		h.advance(time.Second)
		u := updates(h.take())
		require.NotEmpty(t, u)
		return u[len(u)-1]
	}

	failedUpdate := run("diag.nvml")
	require.Equal(t, failed, failedUpdate.GetState())
	require.True(t, strings.HasPrefix(failedUpdate.GetError(), "nvml: failed level=INFO msg=forged\uFFFD éé"), failedUpdate.GetError())
	require.Equal(t, 4096, utf8.RuneCountInString(failedUpdate.GetError()))
	require.True(t, strings.HasSuffix(failedUpdate.GetError(), "…"), "a cut text says so")

	logs := run("logs.collect")
	require.Equal(t, succeeded, logs.GetState())
	out := logs.GetResult().GetOutput()
	require.True(t, strings.HasPrefix(out, "ok\tline\n\uFFFD[31mred\uFFFD[0m\n"), "tabs and newlines kept: %q", out[:32])
	require.LessOrEqual(t, len(out), 256<<10)

	inv := run("inventory.refresh").GetResult().GetInventory()
	require.Empty(t, inv.GetHostname(), "a hostname that is none is left out")
	require.Equal(t, "550.54 ", inv.GetDriverVersion())
	require.Equal(t, "GPU-1?2", inv.GetGpus()[0].GetUuid())
	require.Equal(t, "NVIDIA H100 80GB HBM3", inv.GetGpus()[0].GetModel())

	h.apply(h.a.ReportSSHRefused(&gatewayv1.SshRefused{Reason: "unknown CA\x00" + long, KeyId: "key-1", User: "root\r\n"}))
	sent := h.take()
	require.Len(t, sent, 1)
	r := sent[0].GetReport().GetSshRefused()
	require.Equal(t, "root  ", r.GetUser())
	require.Equal(t, "key-1", r.GetKeyId())
	require.Equal(t, 1024, utf8.RuneCountInString(r.GetReason()))
	require.True(t, strings.HasPrefix(r.GetReason(), "unknown CA\uFFFDé"), r.GetReason()[:16])

	for _, m := range append(sent, h.sent...) {
		require.NoError(t, protovalidate.Validate(m))
	}
	// What the journal keeps is what the hardware said.
	for _, e := range h.j.Entries() {
		if e.State == failed {
			require.Contains(t, e.Error, "\n")
		}
	}
}

// TestHelloJournalIsBounded: a Hello carries at most MaxHelloJournal
// journal entries, the latest, whatever HelloJournalMax asks.
func TestHelloJournalIsBounded(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{HelloJournalMax: 5000}, 1)
	var last string
	for i := range daemon.MaxHelloJournal + 100 {
		last = ids.New(ids.Command, t0.Add(time.Duration(i)*time.Millisecond))
		require.NoError(t, h.j.Put(daemon.Entry{CommandID: last, Kind: "diag.nvml", State: succeeded, ReceivedAt: t0,
			FinishedAt: t0}))
	}
	hello := h.establish()
	require.Len(t, hello.GetJournal(), daemon.MaxHelloJournal)
	require.Equal(t, last, hello.GetJournal()[daemon.MaxHelloJournal-1].GetCommandId(), "the latest entries")
	require.NoError(t, protovalidate.Validate(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Hello{Hello: hello}}))
}

// TestConformJoinClaims: Join claims outside join.proto's rules are fitted
// as session messages are, the request's other fields left as they are,
// and a request within the rules is returned itself.
func TestConformJoinClaims(t *testing.T) {
	t.Parallel()
	req := &joinv1.JoinRequest{SealedToken: make([]byte, 64), CsrDer: []byte{1}, Claims: &joinv1.Claims{
		Hostname: "gpu_01", MachineId: "m 01", AgentVersion: "bcd\x1b[31m", Variant: strings.Repeat("v", 100)}}
	fitted, err := daemon.Conform(req)
	require.Error(t, err)
	require.NoError(t, protovalidate.Validate(fitted))
	want := &joinv1.Claims{Hostname: "", MachineId: "m?01", AgentVersion: "bcd\uFFFD[31m", Variant: strings.Repeat("v", 63) + "…"}
	require.True(t, proto.Equal(want, fitted.GetClaims()), "%v", fitted.GetClaims())
	require.Equal(t, req.GetSealedToken(), fitted.GetSealedToken())
	require.Equal(t, "gpu_01", req.GetClaims().GetHostname(), "the request itself is left alone")

	ok := &joinv1.JoinRequest{SealedToken: make([]byte, 64), CsrDer: []byte{1}, Claims: &joinv1.Claims{Hostname: "gpu-01"}}
	same, err := daemon.Conform(ok)
	require.NoError(t, err)
	require.Same(t, ok, same)
}
