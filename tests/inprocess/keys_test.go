package inprocess_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/controllers/controllers"
	"github.com/better-compute/better-compute/services/gateway/gateway"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// TestEachServiceStartsWithOnlyItsKeys checks the PKI layout (pki.Layout)
// against the services, each configured as compose runs it (signed intent
// on): given only its files (pki.Export), a service starts — every stack of
// this suite runs that way (devstack) — and without any one of them it does
// not, with an error naming the missing file. Two files are optional by
// design, and the service starts without them: the gateway's
// tunnel-ticket.pub (it then refuses every tunnel) and the controllers' SSH
// CA public keys (read by the ssh-cas reconciler, which then leaves the
// nodes' CAs as they are).
func TestEachServiceStartsWithOnlyItsKeys(t *testing.T) {
	st := setup(t).stack
	nc, err := bus.Connect(st.NATSURL, "keys-test", nil)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	signed := service.Intent{SignedIntent: true}
	noProbes := service.Probes{NoHealthServer: true}
	start := map[string]func(dir string) error{
		pki.ServiceAPI: func(dir string) error {
			_, err := api.New(api.Config{PKI: service.PKI{PKIDir: dir}, Intent: signed}, api.Deps{DB: st.DB})
			return err
		},
		pki.ServiceJoinService: func(dir string) error {
			_, err := joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: dir}, Intent: signed}, joinservice.Deps{DB: st.DB})
			return err
		},
		pki.ServiceGateway: func(dir string) error {
			_, err := gateway.New(gateway.Config{PKI: service.PKI{PKIDir: dir}, Probes: noProbes, ControlURL: "http://gw:8086"},
				gateway.Deps{DB: st.DB, NC: nc})
			return err
		},
		pki.ServiceScheduler: func(dir string) error {
			_, err := scheduler.New(scheduler.Config{PKI: service.PKI{PKIDir: dir}, Intent: signed, Probes: noProbes},
				scheduler.Deps{DB: st.DB, NC: nc})
			return err
		},
		pki.ServiceControllers: func(dir string) error {
			_, err := controllers.New(controllers.Config{PKI: service.PKI{PKIDir: dir}, Intent: signed, Probes: noProbes},
				controllers.Deps{DB: st.DB, NC: nc})
			return err
		},
	}
	optional := map[string]bool{
		pki.ServiceGateway + "/" + pki.TunnelTicketPub:        true,
		pki.ServiceControllers + "/" + pki.SSHBreakGlassCAPub: true,
		pki.ServiceControllers + "/" + pki.SSHSandboxCAPub:    true,
	}
	require.Len(t, start, len(pki.Services()), "every service of the layout is started here")
	for _, name := range pki.Services() {
		t.Run(name, func(t *testing.T) {
			files, err := pki.Layout(name)
			require.NoError(t, err)
			dir := filepath.Join(t.TempDir(), name)
			_, err = pki.Export(st.PKIDir, name, dir)
			require.NoError(t, err)
			require.NoError(t, start[name](dir), "%s starts with only its files", name)
			for _, f := range files {
				t.Run("without "+f, func(t *testing.T) {
					dir := filepath.Join(t.TempDir(), name)
					_, err := pki.Export(st.PKIDir, name, dir)
					require.NoError(t, err)
					require.NoError(t, os.Remove(filepath.Join(dir, f)))
					err = start[name](dir)
					if optional[name+"/"+f] {
						require.NoError(t, err)
						return
					}
					require.ErrorContains(t, err, filepath.Join(dir, f))
				})
			}
		})
	}
}
