package cli

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

func (a *app) pkiCmd() *cobra.Command {
	c := &cobra.Command{Use: "pki", Short: "Manage a deployment's certificate authorities"}
	c.AddCommand(a.pkiInitCmd(), a.pkiExportCmd())
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
	{pki.JoinServiceCert, false}, {pki.JoinServiceKey, true},
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
		joinNames   []string
		pinsOut     string
	)
	c := &cobra.Command{
		Use:   "init [--dir DIR]",
		Short: "Create the deployment's CAs, join and signing keys where missing, and print its pins",
		Long: "pki init writes a deployment's PKI into DIR (--dir, else BETTER_COMPUTE_PKI_DIR, else /var/lib/better-compute/pki):\n" +
			"node-ca.crt/key (signs node certificates), serving-ca.crt/key\n" +
			"(signs the gateway's and JoinService's certificates, pinned by daemons), gateway.crt/key (the gateways' serving\n" +
			"certificate, and their client certificate toward JoinService), joinservice.crt/key (JoinService's control\n" +
			"listener, where gateways have renewals signed), trust-domain, join-encryption.key/.pub\n" +
			"(JoinService's HPKE key, which join tokens are sealed to), join-signing.key/.pub (signs JoinResponses),\n" +
			"command-signing.key/.pub (signs commands and specs with signedIntent), tunnel-ticket.key/.pub (signs exec\n" +
			"tickets, which gateways verify), ssh-break-glass-ca.key/.pub and ssh-sandbox-ca.key/.pub (the SSH user CAs\n" +
			"that nodes trust) and pins.json. Existing files are kept:\n" +
			"a private key is never replaced (a missing .pub, gateway.crt or joinservice.crt is derived from its key, and a\n" +
			"gateway.crt without the client-auth usage is issued again for its key; a CA or key missing\n" +
			"its other half, or a file that does not parse, is an error naming it), and a private key readable by group\n" +
			"or others is set to 0600 with a warning.\n" +
			"It prints the files it wrote and the pins daemons need (public), never key material; keys are written\n" +
			"owner-only (0600).",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&dir, "dir", "", "PKI directory (env BETTER_COMPUTE_PKI_DIR, default /var/lib/better-compute/pki)")
	c.Flags().StringVar(&trustDomain, "trust-domain", "", "SPIFFE trust domain of node certificates (default "+pki.DefaultTrustDomain+")")
	c.Flags().StringSliceVar(&names, "gateway-name", nil, "DNS name or IP of the gateway certificate (repeatable; default gateway, localhost, 127.0.0.1)")
	c.Flags().StringSliceVar(&joinNames, "joinservice-name", nil,
		"DNS name or IP of JoinService's certificate, which gateways verify (repeatable; default joinservice, localhost, 127.0.0.1)")
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
		res, err := pki.Init(dir, pki.InitOptions{TrustDomain: trustDomain, GatewayNames: names, JoinServiceNames: joinNames}, a.env.Clock.Now())
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

func (a *app) pkiExportCmd() *cobra.Command {
	var (
		dir, out, name string
		all            bool
	)
	c := &cobra.Command{
		Use:   "export [--dir DIR] (--service NAME --out OUT | --all --out ROOT)",
		Short: "Copy the files of a PKI directory that one service reads into a directory of its own",
		Long: "pki export copies, from the PKI directory DIR that pki init made, only the files service NAME reads into OUT,\n" +
			"which becomes that service's BETTER_COMPUTE_PKI_DIR (a volume or secret of its own), so that no service holds\n" +
			"another's keys (docs/architecture.md, \"Keys and roles\"). With --all, each service's files go to ROOT/<service>.\n" +
			"The services and their files:\n" + pkiLayoutText() +
			"No service gets serving-ca.key or pins.json. Files are written only when they differ, private keys 0600 and\n" +
			"the others 0644; a file of a PKI directory in OUT that is not the service's is removed (other files are left\n" +
			"alone). A file missing from DIR is an error naming it; run pki init first. Run it again after rotating a\n" +
			"file in DIR.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&dir, "dir", "", "PKI directory that pki init made (env BETTER_COMPUTE_PKI_DIR, default /var/lib/better-compute/pki)")
	c.Flags().StringVar(&name, "service", "", "service whose files to export: one of "+strings.Join(pki.Services(), ", "))
	c.Flags().BoolVar(&all, "all", false, "export every service's files, each into ROOT/<service>")
	c.Flags().StringVar(&out, "out", "", "directory to write (made 0700 when missing): the service's PKI directory, or ROOT with --all")
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		switch {
		case out == "":
			return errors.New("--out is required")
		case all && name != "":
			return errors.New("pass --service NAME or --all, not both")
		case !all && name == "":
			return errors.New("pass --service NAME (or --all)")
		}
		if dir == "" {
			var p service.PKI
			if err := config.Load(&p, a.env.Getenv); err != nil {
				return err
			}
			dir = p.PKIDir
		}
		targets := map[string]string{}
		if all {
			for _, svc := range pki.Services() {
				targets[svc] = filepath.Join(out, svc)
			}
		} else {
			if _, err := pki.Layout(name); err != nil {
				return fmt.Errorf("--service: %w", err)
			}
			targets[name] = out
		}
		for _, name := range pki.Services() {
			to, ok := targets[name]
			if !ok {
				continue
			}
			res, err := pki.Export(dir, name, to)
			if err != nil {
				return fmt.Errorf("pki export: %w", err)
			}
			for _, f := range res.Wrote {
				note := ""
				if pki.IsPrivateKey(f) {
					note = " (private key, mode 0600)"
				}
				fmt.Fprintf(a.env.Stdout, "%s: wrote %s%s\n", name, filepath.Join(to, f), note)
			}
			for _, f := range res.Removed {
				fmt.Fprintf(a.env.Stdout, "%s: removed %s (not %s's)\n", name, filepath.Join(to, f), name)
			}
			if len(res.Wrote)+len(res.Removed) == 0 {
				fmt.Fprintf(a.env.Stdout, "%s: %s is up to date\n", name, to)
			}
		}
		return nil
	}
	return c
}

// pkiLayoutText lists each service's files (pki.Layout), one line each.
func pkiLayoutText() string {
	var b strings.Builder
	for _, name := range pki.Services() {
		files, _ := pki.Layout(name)
		fmt.Fprintf(&b, "  %-12s %s\n", name, strings.Join(files, " "))
	}
	return b.String()
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
