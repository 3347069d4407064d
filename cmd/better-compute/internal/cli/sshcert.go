package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/sshca"
)

// sshCertJSON is what `ssh-cert -o json` prints. Times are RFC 3339 in UTC.
type sshCertJSON struct {
	// Certificate is the OpenSSH certificate in authorized_keys format.
	Certificate string `json:"certificate"`
	// File is where it was written ("" with --cert-file -).
	File string `json:"file"`
	// Serial is the certificate's serial, in decimal: 64 bits do not fit
	// a JSON number exactly.
	Serial      string    `json:"serial"`
	KeyID       string    `json:"keyId"`
	Principals  []string  `json:"principals"`
	ValidAfter  time.Time `json:"validAfter"`
	ValidBefore time.Time `json:"validBefore"`
	// CA is "break-glass" or "sandbox".
	CA string `json:"ca"`
}

// certFileFor is where OpenSSH looks for the certificate of the key whose
// public half is in pubFile: the private key's path with "-cert.pub".
func certFileFor(pubFile string) string {
	return strings.TrimSuffix(pubFile, ".pub") + "-cert.pub"
}

func (a *app) sshCertCmd() *cobra.Command {
	var node, keyFile, reservation, certFile string
	ttl := lifetime(sshca.DefaultTTL)
	c := &cobra.Command{
		Use:   "ssh-cert (--node NODE_ID | --reservation RES_ID) --public-key FILE [--ttl D] [--cert-file FILE]",
		Short: "Get an SSH certificate for your public key, valid on one node for up to an hour",
		Long: "ssh-cert asks the API to sign an OpenSSH user certificate for the public key in --public-key\n" +
			"(TunnelService.IssueSshCertificate) and writes it next to the key, where ssh looks for it: the key's\n" +
			"path with .pub replaced by -cert.pub (~/.ssh/id_ed25519.pub → ~/.ssh/id_ed25519-cert.pub), mode\n" +
			"0644, or --cert-file (- prints it on standard output, and what was issued on standard error). The\n" +
			"certificate is valid on --node only (with --reservation, default: the reservation's node), for\n" +
			"--ttl (1s to 1h, default 15m: a duration such as 30m, or whole seconds such as 600). Without\n" +
			"--reservation it is a break-glass certificate from the break-glass CA, principal root (a\n" +
			"tenant-admin token of the node's tenant or a root-admin token); with --reservation, a sandbox\n" +
			"certificate from the sandbox CA, principal the reservation id, valid no later than the\n" +
			"reservation's end (a tenant-member, tenant-admin or root-admin token of the tenant holding that\n" +
			"active reservation: a viewer's is refused). It prints the serial,\n" +
			"key id, principals, validity and CA; -o json prints them with the certificate and the file. The\n" +
			"API audits every certificate with its serial. Log in with ssh-proxy as ProxyCommand (see\n" +
			"ssh-proxy --help).",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&node, "node", "", "node id the certificate is valid on (required without --reservation)")
	c.Flags().StringVar(&keyFile, "public-key", "", "your SSH public key file, e.g. ~/.ssh/id_ed25519.pub: Ed25519, ECDSA or RSA of at least 2048 bits (required)")
	c.Flags().Var(&ttl, "ttl", "how long the certificate is valid, 1s to 1h: a duration such as 15m or 1h, or whole seconds such as 600")
	c.Flags().StringVar(&reservation, "reservation", "", "reservation id: a certificate for its sandbox on the node")
	_ = c.RegisterFlagCompletionFunc("reservation", a.completeReservationIDs(true))
	c.Flags().StringVar(&certFile, "cert-file", "", "where to write the certificate (default: the key's path with -cert.pub; - for standard output)")
	format := addOutputFlag(c)
	_ = c.MarkFlagRequired("public-key")
	_ = c.MarkFlagFilename("public-key", "pub")
	_ = c.RegisterFlagCompletionFunc("node", a.completeNodeIDs)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := checkFormat(*format); err != nil {
			return err
		}
		if err := checkTTL(time.Duration(ttl), sshca.MaxTTL, "1h", ""); err != nil {
			return err
		}
		text, pub, err := readPublicKey(keyFile)
		if err != nil {
			return err
		}
		if certFile == "" {
			certFile = certFileFor(keyFile)
		}
		if node == "" && reservation == "" {
			return errNodeOrReservation
		}
		cl, err := a.clients()
		if err != nil {
			return err
		}
		req := &computev1.IssueSshCertificateRequest{NodeId: canonicalID(ids.Node, node), PublicKey: text,
			Ttl: durationpb.New(time.Duration(ttl))}
		if reservation != "" {
			req.ReservationId = canonicalID(ids.Reservation, reservation)
			if req.NodeId, err = reservationNode(cmd.Context(), cl, req.ReservationId, req.NodeId); err != nil {
				return err
			}
		}
		res, err := cl.tunnels.IssueSshCertificate(cmd.Context(), connect.NewRequest(req))
		if err != nil {
			return asFlags(err)
		}
		m := res.Msg
		if err := checkCertificate(m.GetCertificate(), pub); err != nil {
			return err
		}
		out := sshCertJSON{Certificate: m.GetCertificate(), File: certFile, Serial: strconv.FormatUint(m.GetSerial(), 10),
			KeyID: m.GetKeyId(), Principals: m.GetPrincipals(), ValidAfter: m.GetValidAfter().AsTime().UTC(),
			ValidBefore: m.GetValidBefore().AsTime().UTC(), CA: m.GetCa()}
		if out.Principals == nil {
			out.Principals = []string{}
		}
		summary := a.env.Stdout
		if certFile == "-" {
			out.File = ""
			if *format == formatJSON {
				return writeJSON(a.env.Stdout, out) // it holds the certificate
			}
			fmt.Fprintln(a.env.Stdout, out.Certificate)
			summary = a.env.Stderr
		} else if err := writeFileAtomic(certFile, []byte(out.Certificate+"\n"), 0o644); err != nil {
			return fmt.Errorf("write the certificate: %w", err)
		}
		if *format == formatJSON {
			return writeJSON(summary, out)
		}
		if out.File != "" {
			fmt.Fprintf(summary, "wrote %s\n", out.File)
		}
		valid := out.ValidBefore.Sub(out.ValidAfter)
		fmt.Fprintf(summary, "serial:       %s\nkey id:       %s\nprincipals:   %s\nvalid until:  %s (%s from %s)\nca:           %s\n",
			out.Serial, cell(out.KeyID), cell(strings.Join(out.Principals, ",")), out.ValidBefore.Format(time.RFC3339), valid,
			out.ValidAfter.Format(time.RFC3339), cell(out.CA))
		return nil
	}
	return c
}

// maxPublicKeyFile is the most bytes of a --public-key file read: the
// API's bound on IssueSshCertificateRequest.public_key (compute.proto); an
// OpenSSH public key line is under 1 KiB even for RSA 4096.
const maxPublicKeyFile = 16384

// readPublicKey reads the SSH public key in file: its text (trimmed, with
// its comment) and the key. It reads at most maxPublicKeyFile bytes, so
// that a wrong path (a device, a huge file) fails at once. Errors name
// --public-key.
func readPublicKey(file string) (string, ssh.PublicKey, error) {
	f, err := os.Open(file)
	if err != nil {
		return "", nil, fmt.Errorf("--public-key: %w", err)
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.IsDir() {
		return "", nil, fmt.Errorf("--public-key %s: a directory, not a public key file", file)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxPublicKeyFile+1))
	if err != nil {
		return "", nil, fmt.Errorf("--public-key %s: %w", file, err)
	}
	if len(b) > maxPublicKeyFile {
		return "", nil, fmt.Errorf("--public-key %s: more than %d bytes: not an SSH public key", file, maxPublicKeyFile)
	}
	pub, err := sshca.ParseUserKey(string(b))
	if err != nil {
		if bytes.Contains(b, []byte("PRIVATE KEY")) {
			return "", nil, fmt.Errorf("--public-key %s: a private key, not a public key: pass the .pub file beside it", file)
		}
		return "", nil, fmt.Errorf("--public-key %s: %w", file, err)
	}
	return strings.TrimSpace(string(b)), pub, nil
}

// checkCertificate checks that text, the API's answer, is an OpenSSH
// certificate of pub, before it is written where ssh will use it.
func checkCertificate(text string, pub ssh.PublicKey) error {
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(text))
	if err != nil {
		return errors.New("the API's certificate does not parse as an OpenSSH certificate")
	}
	cert, ok := k.(*ssh.Certificate)
	if !ok || !bytes.Equal(cert.Key.Marshal(), pub.Marshal()) {
		return errors.New("the API's answer is not a certificate of this public key")
	}
	return nil
}
