package api

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

// wellKnownMaxAge is how long clients and proxies may cache the well-known
// document, in seconds: it changes only when the deployment's keys or URLs
// do.
const wellKnownMaxAge = 300

// WellKnownConfig configures GET /.well-known/better-compute
// (pki.WellKnownPath), the document a daemon joins from with just a URL and
// its pins. It publishes the public files of the PKI directory
// (join-encryption.pub, join-signing.pub, serving-ca.crt,
// command-signing.pub); without one it is not served (404). GatewayURL must
// be empty or a list of https://HOST[:PORT], else New fails.
type WellKnownConfig struct {
	// PublicURL is the API's public base URL, published as baseUrl; unset,
	// the scheme and Host of each request.
	PublicURL string `env:"PUBLIC_URL"`
	// JoinURL is JoinService's base URL as machines reach it, published as
	// joinUrl.
	JoinURL string `env:"JOIN_URL"`
	// Gateways are published as gateway.urls and gateway.serverName; unset,
	// none.
	service.Gateways `default:"GATEWAY_URL=;GATEWAY_SERVER_NAME="`
}

// newWellKnownHandler reads the public files of cfg.PKIDir once and returns
// the handler of pki.WellKnownPath: unauthenticated, GET and HEAD only (the
// mux pattern answers 405 otherwise), JSON (pki.WellKnown), cacheable for
// wellKnownMaxAge seconds with a strong ETag (If-None-Match answers 304).
// Errors name the PKI file that is missing or broken, or say what is wrong
// with GATEWAY_URL.
func newWellKnownHandler(cfg WellKnownConfig, pkiDir string) (http.Handler, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if pkiDir == "" {
		return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "the well-known document is not configured (no "+config.Prefix+"PKI_DIR)", http.StatusNotFound)
		}), nil
	}
	doc, err := pki.NewWellKnown(pkiDir)
	if err != nil {
		return nil, fmt.Errorf("well-known document: %w", err)
	}
	doc.JoinURL = cfg.JoinURL
	doc.Gateway = pki.NewWellKnownGateway(cfg.GatewayURL, cfg.GatewayServerName)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d := doc
		d.BaseURL = cfg.PublicURL
		if d.BaseURL == "" {
			scheme := "http"
			if r.TLS != nil {
				scheme = "https"
			}
			d.BaseURL = scheme + "://" + r.Host
			w.Header().Set("Vary", "Host")
		}
		body, err := json.MarshalIndent(d, "", "  ")
		if err != nil {
			http.Error(w, "internal error", http.StatusInternalServerError)
			return
		}
		body = append(body, '\n')
		sum := sha256.Sum256(body)
		etag := `"` + hex.EncodeToString(sum[:16]) + `"`
		h := w.Header()
		h.Set("Content-Type", "application/json")
		h.Set("Cache-Control", fmt.Sprintf("public, max-age=%d", wellKnownMaxAge))
		h.Set("ETag", etag)
		h.Set("X-Content-Type-Options", "nosniff")
		if r.Header.Get("If-None-Match") == etag {
			w.WriteHeader(http.StatusNotModified)
			return
		}
		if r.Method == http.MethodHead {
			return
		}
		_, _ = w.Write(body)
	}), nil
}
