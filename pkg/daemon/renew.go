package daemon

import (
	"crypto"
	"crypto/x509"
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// renewPhase is where a certificate renewal stands.
type renewPhase uint8

const (
	// renewIdle waits for renewal.at to start one.
	renewIdle renewPhase = iota
	// renewCSR has asked the driver for a CSR (EffectMakeCSR) until at.
	renewCSR
	// renewSent has sent RenewCertificate and waits for CertificateIssued
	// until at.
	renewSent
)

// renewal is the node certificate in use and the state of its renewal.
type renewal struct {
	notBefore, notAfter time.Time
	receivedAt          time.Time // when the certificate in use arrived (zero: unknown)
	phase               renewPhase
	// at is when to start a renewal (renewIdle) or when the one in flight
	// has failed for want of an answer (renewCSR, renewSent).
	at       time.Time
	csr      []byte // the CSR sent (renewSent)
	failures int    // renewals failed in a row
	renewals int    // certificates renewed
}

// renewPoint is when two thirds of the certificate's lifetime have passed,
// counted from the later of its NotBefore and when it was received (so a
// NotBefore backdated for clock skew cannot make a fresh certificate due at
// once), or the zero time when the Agent renews nothing.
func (a *Agent) renewPoint() time.Time {
	if a.cert.notAfter.IsZero() {
		return time.Time{}
	}
	from := a.cert.notBefore
	if a.cert.receivedAt.After(from) {
		from = a.cert.receivedAt
	}
	return from.Add(a.cert.notAfter.Sub(from) * 2 / 3)
}

// renewDeadline is when the renewal next needs a Tick. Renewal runs only on
// an established session; the zero time otherwise.
func (a *Agent) renewDeadline() time.Time {
	if a.cert.notAfter.IsZero() || a.state != StateEstablished {
		return time.Time{}
	}
	return a.cert.at
}

// renewStep handles a due renewal deadline: it starts a renewal, or fails
// the one that got no answer in time.
func (a *Agent) renewStep(now time.Time, o *out) {
	switch a.cert.phase {
	case renewIdle:
		a.cert.phase = renewCSR
		a.cert.at = now.Add(a.cfg.RenewTimeout)
		o.add(Effect{Kind: EffectMakeCSR})
	case renewCSR:
		a.renewFailed(now, "the driver made no CSR within "+a.cfg.RenewTimeout.String())
	case renewSent:
		a.renewFailed(now, "the gateway did not answer the renewal within "+a.cfg.RenewTimeout.String())
	}
}

// renewFailed ends the renewal in flight, if any, and schedules the next
// attempt with backoff.
func (a *Agent) renewFailed(now time.Time, reason string) {
	a.cert.failures++
	a.cert.phase = renewIdle
	a.cert.csr = nil
	c := BackoffCap(a.cfg.RenewBackoffMin, a.cfg.RenewBackoffMax, a.cert.failures)
	delay := c/2 + time.Duration(a.rnd.Int64N(int64(c/2)+1))
	a.cert.at = now.Add(delay)
	a.cfg.Logger.Warn("certificate renewal failed; retrying", "reason", reason, "attempt", a.cert.failures,
		"retry_in", delay.String(), "not_after", a.cert.notAfter)
}

// RenewalCSR hands the Agent the CSR (DER) it asked for with EffectMakeCSR,
// and proof, the driver's signature of it by the key of the certificate in
// use (pkg/pki SignRenewal; gateway.proto, RenewCertificate.proof); it sends
// RenewCertificate on the established session. A CSR that is no longer
// awaited is ignored; one that arrives while no session is established is
// dropped and asked for again after the next Welcome.
func (a *Agent) RenewalCSR(now time.Time, csrDER, proof []byte) []Effect {
	var o out
	if a.cert.phase != renewCSR {
		return a.finish(&o)
	}
	if a.state != StateEstablished {
		a.cert.phase = renewIdle
		a.cert.at = now
		return a.finish(&o)
	}
	a.cert.phase = renewSent
	a.cert.csr = csrDER
	a.cert.at = now.Add(a.cfg.RenewTimeout)
	a.send(&o, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_RenewCertificate{
		RenewCertificate: &gatewayv1.RenewCertificate{CsrDer: csrDER, Proof: proof},
	}})
	return a.finish(&o)
}

// RenewalFailed reports that the driver could not make the CSR
// (EffectMakeCSR) or store the new certificate (EffectCertificate); err says
// why. The Agent tries again with backoff.
func (a *Agent) RenewalFailed(now time.Time, err error) []Effect {
	var o out
	if a.cert.notAfter.IsZero() {
		return nil
	}
	reason := "driver failed"
	if err != nil {
		reason = err.Error()
	}
	a.renewFailed(now, reason)
	return a.finish(&o)
}

// issued handles CertificateIssued: a certificate for the key of the CSR
// sent becomes the one in use and goes to the driver (EffectCertificate);
// a refusal or a certificate that does not fit is retried with backoff.
func (a *Agent) issued(now time.Time, o *out, ci *gatewayv1.CertificateIssued) {
	if a.cert.phase != renewSent {
		return
	}
	if ci.GetError() != "" || len(ci.GetCertificateDer()) == 0 {
		a.renewFailed(now, "the gateway refused the renewal: "+ci.GetError())
		return
	}
	cert, err := x509.ParseCertificate(ci.GetCertificateDer())
	if err != nil {
		a.renewFailed(now, "the issued certificate does not parse: "+err.Error())
		return
	}
	csr, err := x509.ParseCertificateRequest(a.cert.csr)
	if err != nil {
		a.renewFailed(now, "the renewal's CSR does not parse: "+err.Error())
		return
	}
	if k, ok := csr.PublicKey.(interface{ Equal(crypto.PublicKey) bool }); !ok || !k.Equal(cert.PublicKey) {
		a.renewFailed(now, "the issued certificate is not for the key of the CSR")
		return
	}
	if !cert.NotAfter.After(now) || !cert.NotBefore.Before(cert.NotAfter) {
		a.renewFailed(now, "the issued certificate is not valid now")
		return
	}
	a.cert.notBefore, a.cert.notAfter, a.cert.receivedAt = cert.NotBefore, cert.NotAfter, now
	a.cert.phase = renewIdle
	a.cert.csr = nil
	a.cert.failures = 0
	a.cert.renewals++
	// Never renew again sooner than RenewBackoffMin, however short the
	// certificate.
	a.cert.at = a.renewPoint()
	if minAt := now.Add(a.cfg.RenewBackoffMin); a.cert.at.Before(minAt) {
		a.cert.at = minAt
	}
	o.add(Effect{Kind: EffectCertificate, Certificate: ci.GetCertificateDer(), NotAfter: cert.NotAfter})
}
