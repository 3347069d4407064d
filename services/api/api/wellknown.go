package api

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

// wellKnownMaxAge is how long clients and proxies may cache the well-known
// document, in seconds: it changes only when the deployment's keys or URLs
// do.
const wellKnownMaxAge = 300

// WellKnownConfig configures GET /.well-known/better-compute
// (pki.WellKnownPath), the document a daemon joins from with just a URL and
// its pins.
type WellKnownConfig struct {
	// PKIDir is the PKI directory whose public files (join-encryption.pub,
	// join-signing.pub, serving-ca.crt, command-signing.pub) the document
	// publishes (BC_PKI_DIR). Empty: the document is not served (404).
	PKIDir string
	// PublicURL is the API's public base URL, published as baseUrl
	// (BC_PUBLIC_URL). Empty: the scheme and Host of each request.
	PublicURL string
	// JoinURL is JoinService's base URL as daemons reach it (BC_JOIN_URL).
	JoinURL string
	// GatewayURL and GatewayServerName are where daemons open their Session
	// and the TLS name they verify there (BC_GATEWAY_URL: one URL or every
	// gateway replica's, separated by commas, each https://HOST[:PORT], else
	// New fails; BC_GATEWAY_SERVER_NAME).
	GatewayURL        string
	GatewayServerName string
}

// wellKnownConfigFromEnv reads WellKnownConfig from the environment.
func wellKnownConfigFromEnv() WellKnownConfig {
	return WellKnownConfig{
		PKIDir:            service.Env("BC_PKI_DIR", ""),
		PublicURL:         service.Env("BC_PUBLIC_URL", ""),
		JoinURL:           service.Env("BC_JOIN_URL", ""),
		GatewayURL:        service.Env("BC_GATEWAY_URL", ""),
		GatewayServerName: service.Env("BC_GATEWAY_SERVER_NAME", ""),
	}
}

// newWellKnownHandler reads the public files of cfg.PKIDir once and returns
// the handler of pki.WellKnownPath: unauthenticated, GET and HEAD only (the
// mux pattern answers 405 otherwise), JSON (pki.WellKnown), cacheable for
// wellKnownMaxAge seconds with a strong ETag (If-None-Match answers 304).
// Errors name the PKI file that is missing or broken, or say what is wrong
// with BC_GATEWAY_URL.
func newWellKnownHandler(cfg WellKnownConfig) (http.Handler, error) {
	if _, err := pki.ParseGatewayURLs(cfg.GatewayURL); err != nil {
		return nil, fmt.Errorf("BC_GATEWAY_URL: %w", err)
	}
	if cfg.PKIDir == "" {
		return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "the well-known document is not configured (no BC_PKI_DIR)", http.StatusNotFound)
		}), nil
	}
	doc, err := pki.NewWellKnown(cfg.PKIDir)
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
