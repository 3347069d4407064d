package cli

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

func (a *app) pkiCmd() *cobra.Command {
	c := &cobra.Command{Use: "pki", Short: "Manage a deployment's certificate authorities"}
	c.AddCommand(a.pkiInitCmd())
	return c
}

// pkiFiles are the files pki.Init may write, private keys marked.
var pkiFiles = []struct {
	name string
	key  bool
}{
	{pki.TrustDomainTxt, false},
	{pki.NodeCACert, false}, {pki.NodeCAKey, true},
	{pki.ServingCACert, false}, {pki.ServingCAKey, true},
	{pki.GatewayCert, false}, {pki.GatewayKey, true},
	{pki.JoinEncryptionPub, false}, {pki.JoinEncryptionKey, true},
	{pki.JoinSigningPub, false}, {pki.JoinSigningKey, true},
	{pki.CommandSigningPub, false}, {pki.CommandSigningKey, true},
	{pki.TunnelTicketPub, false}, {pki.TunnelTicketKey, true},
	{pki.SSHBreakGlassCAPub, false}, {pki.SSHBreakGlassCAKey, true},
	{pki.SSHSandboxCAPub, false}, {pki.SSHSandboxCAKey, true},
	{pki.PinsJSON, false},
}

func (a *app) pkiInitCmd() *cobra.Command {
	var (
		dir         string
		trustDomain string
		names       []string
		pinsOut     string
	)
	c := &cobra.Command{
		Use:   "init --dir DIR",
		Short: "Create the deployment's CAs, join and signing keys where missing, and print its pins",
		Long: "pki init writes a deployment's PKI into DIR: node-ca.crt/key (signs node certificates), serving-ca.crt/key\n" +
			"(signs gateway certificates, pinned by daemons), gateway.crt/key, trust-domain, join-encryption.key/.pub\n" +
			"(JoinService's HPKE key, which join tokens are sealed to), join-signing.key/.pub (signs JoinResponses),\n" +
			"command-signing.key/.pub (signs commands and specs with signedIntent), tunnel-ticket.key/.pub (signs exec\n" +
			"tickets, which gateways verify), ssh-break-glass-ca.key/.pub and ssh-sandbox-ca.key/.pub (the SSH user CAs\n" +
			"that nodes trust) and pins.json. Existing files are kept:\n" +
			"a private key is never replaced (a missing .pub or gateway.crt is derived from its key; a CA or key missing\n" +
			"its other half, or a file that does not parse, is an error naming it), and a private key readable by group\n" +
			"or others is set to 0600 with a warning.\n" +
			"It prints the files it wrote and the pins daemons need (public), never key material; keys are written\n" +
			"owner-only (0600).",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&dir, "dir", "", "PKI directory (env BETTER_COMPUTE_PKI_DIR, default /var/lib/better-compute/pki)")
	c.Flags().StringVar(&trustDomain, "trust-domain", "", "SPIFFE trust domain of node certificates (default "+pki.DefaultTrustDomain+")")
	c.Flags().StringSliceVar(&names, "gateway-name", nil, "DNS name or IP of the gateway certificate (repeatable; default gateway, localhost, 127.0.0.1)")
	c.Flags().StringVar(&pinsOut, "pins-out", "", "also write the pins (public) to this file, e.g. a volume daemons read, which must not see DIR")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if dir == "" {
			var p service.PKI
			if err := config.Load(&p, a.env.Getenv); err != nil {
				return err
			}
			dir = p.PKIDir
		}
		before := map[string]os.FileInfo{}
		for _, f := range pkiFiles {
			if st, err := os.Stat(filepath.Join(dir, f.name)); err == nil {
				before[f.name] = st
			}
		}
		res, err := pki.Init(dir, pki.InitOptions{TrustDomain: trustDomain, GatewayNames: names}, a.env.Clock.Now())
		if err != nil {
			return fmt.Errorf("pki init %s: %w", dir, err)
		}
		for _, w := range res.Warnings {
			fmt.Fprintf(a.env.Stderr, "warning: %s\n", w)
		}
		td, err := pki.ReadTrustDomain(dir)
		if err != nil {
			return err
		}
		pins, err := pki.ReadPins(dir)
		if err != nil {
			return err
		}
		wroteOut := false
		if pinsOut != "" {
			if wroteOut, err = pki.WritePinsFile(pinsOut, pins); err != nil {
				return fmt.Errorf("--pins-out: %w", err)
			}
		}
		if res.Wrote {
			a.printWritten(dir, before)
			fmt.Fprintf(a.env.Stdout, "trust domain %s\n", td)
		} else {
			fmt.Fprintf(a.env.Stdout, "PKI in %s is complete; nothing written (trust domain %s)\n", dir, td)
		}
		if wroteOut {
			fmt.Fprintf(a.env.Stdout, "wrote %s\n", pinsOut)
		}
		a.printPins(dir, pins)
		if trustDomain != "" && trustDomain != td {
			fmt.Fprintf(a.env.Stderr, "warning: %s already names trust domain %s; --trust-domain %s was ignored\n",
				filepath.Join(dir, pki.TrustDomainTxt), td, trustDomain)
		}
		return nil
	}
	return c
}

// printWritten prints the files of dir that pki.Init wrote: those that did
// not exist before, or changed (Init replaces the gateway certificate when it
// makes a new serving CA).
func (a *app) printWritten(dir string, before map[string]os.FileInfo) {
	for _, f := range pkiFiles {
		st, err := os.Stat(filepath.Join(dir, f.name))
		if err != nil {
			continue
		}
		if old, ok := before[f.name]; ok && os.SameFile(old, st) && old.ModTime().Equal(st.ModTime()) {
			continue
		}
		note := ""
		if f.key {
			note = " (private key, mode 0600)"
		}
		fmt.Fprintf(a.env.Stdout, "wrote %s%s\n", filepath.Join(dir, f.name), note)
	}
}

// printPins prints the deployment's pins: public, what a daemon is given to
// trust the deployment.
func (a *app) printPins(dir string, p pki.Pins) {
	fmt.Fprintf(a.env.Stdout, "pins (for daemons: --pins-file %s, or one flag each):\n", filepath.Join(dir, pki.PinsJSON))
	for _, f := range []struct{ flag, pin string }{
		{"--serving-ca-pin", p.ServingCA}, {"--join-signing-pin", p.JoinSigning},
		{"--join-encryption-pin", p.JoinEncryption}, {"--command-signing-pin", p.CommandSigning},
	} {
		fmt.Fprintf(a.env.Stdout, "  %-22s %s\n", f.flag, f.pin)
	}
}
