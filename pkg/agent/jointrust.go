package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// joinTrust is what every machine of a Runner joins with: the JoinService
// client, JoinService's keys (checked against the pins) and the pins the
// JoinResponse is checked against.
type joinTrust struct {
	client joinv1connect.JoinServiceClient
	keys   pki.JoinKeys
	pins   pki.Pins
}

// joinTrust returns the Runner's joinTrust, resolving it on the first call:
// the keys come from Server's well-known document (fetched with retries on
// transient errors) or from Config, and are checked against every pin given
// (the command-signing pin included) before any Join, so a wrong pin never
// spends a join token.
// Missing pins or keys, and keys that do not match their pins, are errors
// that retrying cannot fix.
func (r *Runner) joinTrust(ctx context.Context) (*joinTrust, error) {
	r.trustMu.Lock()
	defer r.trustMu.Unlock()
	if r.trust != nil {
		return r.trust, nil
	}
	pins := r.cfg.Pins
	joinURL := r.cfg.JoinURL
	var (
		keys pki.JoinKeys
		err  error
	)
	if !r.cfg.InsecureTrustServerPins {
		if err := requirePins(pins); err != nil {
			return nil, err
		}
	}
	if r.cfg.Server != "" {
		doc, err := r.fetchWellKnown(ctx)
		if err != nil {
			return nil, err
		}
		if r.cfg.InsecureTrustServerPins {
			r.log.Warn("INSECURE: trusting the pins of the server's own well-known document (trust on first use); "+
				"whoever answers for the server chooses what this machine trusts",
				"server", r.cfg.Server, "pins.serving_ca", doc.Pins.ServingCA, "pins.join_signing", doc.Pins.JoinSigning)
			pins = doc.Pins
		}
		if err := requirePins(pins); err != nil {
			return nil, err
		}
		if keys, err = doc.JoinKeys(pins); err != nil {
			return nil, fmt.Errorf("%s%s: %w", r.cfg.Server, pki.WellKnownPath, err)
		}
		if joinURL == "" {
			joinURL = doc.JoinURL
		}
		if joinURL == "" {
			return nil, fmt.Errorf("%s%s has no joinUrl: set --join-url (BETTER_COMPUTE_FAKEDAEMON_JOIN_URL)",
				r.cfg.Server, pki.WellKnownPath)
		}
	} else {
		if len(r.cfg.JoinEncryptionKey) == 0 || len(r.cfg.JoinSigningKey) == 0 {
			return nil, errors.New("no join keys: set --server (BETTER_COMPUTE_SERVER) to read them from the " +
				"deployment's well-known document, or --join-keys-dir (BETTER_COMPUTE_JOIN_KEYS_DIR)")
		}
		if joinURL == "" {
			return nil, errors.New("no join URL: set --join-url (BETTER_COMPUTE_FAKEDAEMON_JOIN_URL), " +
				"or --server (BETTER_COMPUTE_SERVER)")
		}
		if keys, err = pki.CheckJoinKeys(pins, r.cfg.JoinEncryptionKey, r.cfg.JoinSigningKey); err != nil {
			return nil, err
		}
		if len(r.cfg.CommandSigningKey) > 0 {
			if err := pki.CheckCommandSigningKey(pins, r.cfg.CommandSigningKey); err != nil {
				return nil, err
			}
		}
	}
	r.trust = &joinTrust{
		client: joinv1connect.NewJoinServiceClient(r.httpClient, strings.TrimRight(joinURL, "/"), r.clientOpts...),
		keys:   keys,
		pins:   pins,
	}
	return r.trust, nil
}

// requirePins refuses to join without the pins that authenticate a
// deployment: servingCa, joinSigning and joinEncryption.
func requirePins(p pki.Pins) error {
	var missing []string
	for _, f := range []struct{ flag, pin string }{
		{"--serving-ca-pin", p.ServingCA}, {"--join-signing-pin", p.JoinSigning}, {"--join-encryption-pin", p.JoinEncryption},
	} {
		if f.pin == "" {
			missing = append(missing, f.flag)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("refusing to join a deployment it cannot authenticate: no pins for %s (give them, or --pins-file with the deployment's %s)",
			strings.Join(missing, ", "), pki.PinsJSON)
	}
	return nil
}

// errPermanent marks a well-known fetch error that retrying cannot fix.
type errPermanent struct{ err error }

func (e errPermanent) Error() string { return e.err.Error() }
func (e errPermanent) Unwrap() error { return e.err }

// fetchWellKnown GETs Server's well-known document, retrying network errors
// and 5xx answers with backoff until ctx ends.
func (r *Runner) fetchWellKnown(ctx context.Context) (*pki.WellKnown, error) {
	url := strings.TrimRight(r.cfg.Server, "/") + pki.WellKnownPath
	for attempt := 1; ; attempt++ {
		doc, err := r.getWellKnown(ctx, url)
		if err == nil {
			return doc, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var perm errPermanent
		if errors.As(err, &perm) {
			return nil, perm.err
		}
		delay := daemon.BackoffCap(r.cfg.JoinBackoffMin, r.cfg.JoinBackoffMax, attempt)
		delay = delay/2 + time.Duration(rand.Int64N(int64(delay/2)+1))
		r.log.Warn("fetching the well-known document failed; retrying", "url", url, "attempt", attempt,
			"in", delay.String(), telemetry.KeyError, err)
		if err := clock.Sleep(ctx, r.clk, delay); err != nil {
			return nil, err
		}
	}
}

func (r *Runner) getWellKnown(ctx context.Context, url string) (*pki.WellKnown, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, errPermanent{fmt.Errorf("server url: %w", err)}
	}
	req.Header.Set("Accept", "application/json")
	resp, err := r.httpClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, pki.MaxWellKnownBytes+1))
	if err != nil {
		return nil, err
	}
	switch {
	case resp.StatusCode >= 500:
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	case resp.StatusCode != http.StatusOK:
		return nil, errPermanent{fmt.Errorf("%s: %s", url, resp.Status)}
	}
	doc, err := pki.ParseWellKnown(body)
	if err != nil {
		return nil, errPermanent{fmt.Errorf("%s: %w", url, err)}
	}
	return doc, nil
}
