package pki_test

import (
	"os"
	"path/filepath"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/pki"
)

// listDir returns the names of the files in dir with their modes.
func listDir(t *testing.T, dir string) map[string]os.FileMode {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	out := map[string]os.FileMode{}
	for _, e := range entries {
		st, err := e.Info()
		require.NoError(t, err)
		out[e.Name()] = st.Mode().Perm()
	}
	return out
}

// TestLayoutKeepsTheSigningKeysApart is the point of the layout: the
// command-signing key only with the services that sign commands and specs,
// the join keys and the node CA's key only with JoinService (so that no
// gateway can mint node identities), the serving CA's key with none, and
// every file a service reads one that Init writes.
func TestLayoutKeepsTheSigningKeysApart(t *testing.T) {
	holders := map[string][]string{}
	for _, svc := range pki.Services() {
		files, err := pki.Layout(svc)
		require.NoError(t, err)
		for _, f := range files {
			require.Contains(t, pki.Files(), f, "%s reads %s, which pki init does not write", svc, f)
			holders[f] = append(holders[f], svc)
		}
	}
	for _, tc := range []struct {
		file string
		want []string
	}{
		{pki.CommandSigningKey, []string{pki.ServiceAPI, pki.ServiceControllers, pki.ServiceScheduler}},
		{pki.JoinSigningKey, []string{pki.ServiceJoinService}},
		{pki.JoinEncryptionKey, []string{pki.ServiceJoinService}},
		{pki.TunnelTicketKey, []string{pki.ServiceAPI}},
		{pki.SSHBreakGlassCAKey, []string{pki.ServiceAPI}},
		{pki.SSHSandboxCAKey, []string{pki.ServiceAPI}},
		{pki.GatewayKey, []string{pki.ServiceGateway}},
		{pki.NodeCAKey, []string{pki.ServiceJoinService}},
		{pki.JoinServiceKey, []string{pki.ServiceJoinService}},
		// The gateways verify JoinService's certificate with it, and
		// JoinService theirs.
		{pki.ServingCACert, []string{pki.ServiceAPI, pki.ServiceGateway, pki.ServiceJoinService}},
		{pki.ServingCAKey, nil},
		{pki.PinsJSON, nil},
	} {
		got := holders[tc.file]
		sort.Strings(got)
		require.Equal(t, tc.want, got, "the services holding %s", tc.file)
	}
	_, err := pki.Layout("fakedaemon")
	require.ErrorContains(t, err, `unknown service "fakedaemon": want one of [api controllers gateway joinservice scheduler]`)
}

// TestExportGivesAServiceOnlyItsFiles: each service's directory holds
// exactly its files, private keys 0600, the same bytes as the PKI
// directory's; a second export writes nothing; a file of another service
// left in the directory is removed, a file of no PKI directory is kept.
func TestExportGivesAServiceOnlyItsFiles(t *testing.T) {
	dir, _ := complete(t)
	for _, svc := range pki.Services() {
		t.Run(svc, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), svc)
			res, err := pki.Export(dir, svc, out)
			require.NoError(t, err)
			files, err := pki.Layout(svc)
			require.NoError(t, err)
			require.Equal(t, files, res.Wrote)
			require.Empty(t, res.Removed)
			want := map[string]os.FileMode{}
			for _, f := range files {
				want[f] = 0o644
				if pki.IsPrivateKey(f) {
					want[f] = 0o600
				}
				require.Equal(t, read(t, filepath.Join(dir, f)), read(t, filepath.Join(out, f)), f)
			}
			require.Equal(t, want, listDir(t, out))
			st, err := os.Stat(out)
			require.NoError(t, err)
			require.Equal(t, os.FileMode(0o700), st.Mode().Perm())

			res, err = pki.Export(dir, svc, out)
			require.NoError(t, err)
			require.Equal(t, pki.ExportResult{}, res, "nothing to do the second time")

			// A key the service must not hold (another's, or the serving
			// CA's) is removed; a file that is no PKI file stays.
			stray := pki.ServingCAKey
			require.NoError(t, os.WriteFile(filepath.Join(out, stray), read(t, filepath.Join(dir, stray)), 0o600))
			require.NoError(t, os.WriteFile(filepath.Join(out, "README"), []byte("mine\n"), 0o644))
			res, err = pki.Export(dir, svc, out)
			require.NoError(t, err)
			require.Equal(t, pki.ExportResult{Removed: []string{stray}}, res)
			want["README"] = 0o644
			require.Equal(t, want, listDir(t, out))
		})
	}
}

// TestExportRefusesAnIncompleteDirectory: a file the service reads that is
// missing from the PKI directory is an error naming it and the service, and
// nothing is written.
func TestExportRefusesAnIncompleteDirectory(t *testing.T) {
	dir, _ := complete(t)
	require.NoError(t, os.Remove(filepath.Join(dir, pki.TunnelTicketPub)))
	out := filepath.Join(t.TempDir(), "gateway")
	_, err := pki.Export(dir, pki.ServiceGateway, out)
	require.ErrorContains(t, err, "gateway reads tunnel-ticket.pub: open "+filepath.Join(dir, pki.TunnelTicketPub))
	require.NoDirExists(t, out)
	// Another service, which does not read it, exports.
	_, err = pki.Export(dir, pki.ServiceScheduler, filepath.Join(t.TempDir(), "scheduler"))
	require.NoError(t, err)
}
