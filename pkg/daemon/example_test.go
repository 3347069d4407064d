package daemon_test

import (
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

// Example drives an Agent the way a discrete-event simulator does: every
// input carries the virtual time, and the driver carries out the effects in
// order — here a "gateway" that welcomes every Hello and one Tick at the
// requested time.
func Example() {
	hw, _ := fakehw.New("l40s", "machine-7")
	a, _ := daemon.New(daemon.Config{NodeID: "node_7"}, hw, daemon.NewMemoryJournal(), rand.New(rand.NewPCG(7, 7)))
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	var wake time.Time
	// Effects are carried out first in, first out: effects of inputs made
	// while carrying out a batch go after the rest of that batch, so the
	// last EffectTimer seen is the current one.
	handle := func(effects []daemon.Effect) {
		for len(effects) > 0 {
			e := effects[0]
			effects = effects[1:]
			fmt.Println(e)
			switch e.Kind {
			case daemon.EffectDial: // the network connects at once
				effects = append(effects, a.Connected(now, e.Session)...)
			case daemon.EffectSend:
				if e.Msg.GetHello() != nil {
					effects = append(effects, a.Receive(now, e.Session, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{
						Welcome: &gatewayv1.Welcome{SessionId: "ses_1", HeartbeatInterval: durationpb.New(10 * time.Second)},
					}})...)
				}
				if hb := e.Msg.GetHeartbeat(); hb != nil { // the gateway answers every heartbeat
					effects = append(effects, a.Receive(now, e.Session, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{
						HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: hb.GetSeq()},
					}})...)
				}
			case daemon.EffectTimer:
				wake = e.At
			}
		}
	}
	handle(a.Start(now))
	now = wake
	handle(a.Tick(now))
	fmt.Println(a.Status().State)
	fmt.Println(wake.Equal(a.NextTimer()))
	// Output:
	// dial[1]
	// send[1] hello node=node_7 boot=c494f373-c6f9-d0eb-dd0c-b67fcf9c186d observed=0 journal=0
	// timer 2030-01-01T00:00:30Z
	// timer 2030-01-01T00:00:10Z
	// send[1] heartbeat seq=1 observed=0
	// timer 2030-01-01T00:00:15Z
	// timer 2030-01-01T00:00:20Z
	// established
	// true
}
