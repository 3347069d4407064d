package agent

// Certificate renewal, the driver's side: the daemon core decides when
// (pkg/daemon, at two thirds of the certificate's lifetime) and talks to the
// gateway; the driver makes the new key and CSR, with the proof that it asks
// for it signed by the key in use (EffectMakeCSR), stores the
// issued certificate with its key in the identity file, atomically
// (EffectCertificate), and presents it from the next dial: a TLS handshake
// reads the newest certificate (clientCert), and the next session gets a new
// connection so that it does handshake.

import (
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"

	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// clientCert is the node certificate a machine presents, replaced on
// renewal; safe for concurrent use.
type clientCert struct {
	p atomic.Pointer[tls.Certificate]
}

// set makes id's key and certificate the ones presented.
func (c *clientCert) set(id *Identity) {
	t := id.tlsCertificate()
	c.p.Store(&t)
}

// get is tls.Config.GetClientCertificate: the newest certificate.
func (c *clientCert) get(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	if t := c.p.Load(); t != nil {
		return t, nil
	}
	return nil, errors.New("no node certificate")
}

// renewState is what the driver keeps for renewals. Only the driver's loop
// touches it.
type renewState struct {
	id      *Identity     // the identity in use
	key     crypto.Signer // the key of the last CSR, until its certificate comes
	fresh   bool          // a renewed certificate awaits a new connection
	tlsCfg  *tls.Config
	tr      *http.Transport   // the transport of the next session
	retired []*http.Transport // earlier transports, closed when idle
}

// renewEffect carries out EffectMakeCSR and EffectCertificate and returns
// the effects of reporting back to the daemon core.
func (d *driver) renewEffect(e daemon.Effect) []daemon.Effect {
	switch e.Kind {
	case daemon.EffectMakeCSR:
		// The proof is signed by the key of the certificate in use, the
		// session's: JoinService, which signs renewals, checks it, so that
		// no gateway can renew for a node that did not ask.
		key, err := pki.GenerateKey()
		var csr, proof []byte
		if err == nil {
			csr, err = pki.NewCSR(key, d.hw.Hostname())
		}
		if err == nil {
			proof, err = pki.SignRenewal(d.rn.id.key, d.rn.id.cert, csr)
		}
		if err != nil {
			d.log.Warn("could not make a CSR for the certificate renewal", telemetry.KeyError, err)
			return d.core.RenewalFailed(d.clk.Now(), err)
		}
		d.rn.key = key
		d.log.Info("renewing the node certificate", "not_after", d.rn.id.cert.NotAfter)
		return d.core.RenewalCSR(d.clk.Now(), csr, proof)
	case daemon.EffectCertificate:
		if err := d.storeCertificate(e.Certificate); err != nil {
			d.log.Warn("could not store the renewed certificate", telemetry.KeyError, err)
			return d.core.RenewalFailed(d.clk.Now(), err)
		}
	}
	return nil
}

// storeCertificate writes the identity with the new key and certificate
// (one atomic, durable write of NodeFile) and presents them from the next
// dial.
func (d *driver) storeCertificate(der []byte) error {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return fmt.Errorf("renewed certificate: %w", err)
	}
	if d.rn.key == nil || !samePublicKey(cert, d.rn.key.Public()) {
		return errors.New("the renewed certificate is not for the key of the last CSR")
	}
	next := *d.rn.id
	next.key, next.cert, next.NotAfter = d.rn.key, cert, cert.NotAfter
	if err := next.save(d.m.dir, nil); err != nil {
		return err
	}
	d.rn.id, d.rn.key, d.rn.fresh = &next, nil, true
	d.m.cert.set(&next)
	d.m.update(func(s *MachineStatus) { s.CertNotAfter, s.Renewals = cert.NotAfter, s.Renewals+1 })
	d.log.Info("node certificate renewed", "cert_serial", pki.SerialHex(cert), "not_after", cert.NotAfter)
	return nil
}

// freshTransport gives the next session a new transport after a renewal, so
// that it opens a new connection whose handshake presents the new
// certificate (an HTTP/2 connection would otherwise be reused).
func (d *driver) freshTransport() {
	if !d.rn.fresh {
		return
	}
	d.rn.fresh = false
	for _, t := range d.rn.retired {
		t.CloseIdleConnections()
	}
	d.rn.retired = append(d.rn.retired, d.rn.tr)
	d.rn.tr = newTransport(d.rn.tlsCfg, d.conns)
	d.makeClients()
}

// closeTransports closes the idle connections of every transport the driver
// made.
func (d *driver) closeTransports() {
	for _, t := range append(d.rn.retired, d.rn.tr) {
		if t != nil {
			t.CloseIdleConnections()
		}
	}
}
