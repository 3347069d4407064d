// Package bootstrap gives a fresh deployment what it needs to be used: the
// root tenant and a root administrator's API token, a site, a metal-host pool
// and a join token for machines, written to files that the rest of a dev
// stack reads (compose's one-shot `better-compute bootstrap`).
//
// It is idempotent: existing rows are reused by name, and the tokens written
// by an earlier run are read back from their files and reused while their
// hashes are still valid in the database, so a re-run changes nothing.
package bootstrap

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

// Names of the variables in the env file.
const (
	EnvTenant = "BETTER_COMPUTE_TENANT"
	EnvToken  = "BETTER_COMPUTE_TOKEN"
	EnvPool   = "BETTER_COMPUTE_POOL"
)

// Options say what to create. Zero values take the defaults of Defaults.
type Options struct {
	TenantName string
	SiteName   string
	Region     string
	PoolName   string
	// GPUModel and ExpectGPUs are the pool's acceptance.
	GPUModel   string
	ExpectGPUs int32
	// JoinMaxUses is how many machines the join token admits.
	JoinMaxUses int32
	// JoinTTL is how long a new join token is valid.
	JoinTTL time.Duration
	// JoinTokenFile receives the join token's secret, owner-only (mode
	// 0600): the machines that read it run as the same user (compose runs
	// bootstrap and the fakedaemons as 65534).
	JoinTokenFile string
	// EnvFile receives `export BETTER_COMPUTE_…=…` lines with the root
	// tenant, root token and pool, owner-only (mode 0600: it holds a
	// root-admin credential). Keep it where machines cannot read it (compose:
	// the secrets volume, not the shared one).
	EnvFile string
}

// Defaults are the options of compose's dev stack.
func Defaults() Options {
	return Options{
		TenantName:    "root",
		SiteName:      "dev-1",
		Region:        "dev-1",
		PoolName:      "metal-host",
		GPUModel:      "H100",
		ExpectGPUs:    8,
		JoinMaxUses:   1000,
		JoinTTL:       365 * 24 * time.Hour,
		JoinTokenFile: "/var/lib/better-compute/shared/join-token",
		EnvFile:       "/var/lib/better-compute/secrets/root.env",
	}
}

// Result is what Run ensured.
type Result struct {
	TenantID string
	SiteID   string
	PoolID   string
	// RootToken is the root administrator's API token (secret).
	RootToken string
	// RootTokenMinted is false when an earlier run's token was reused.
	RootTokenMinted bool
	JoinTokenID     string
	// JoinToken is the join token's secret.
	JoinToken string
	// JoinTokenMinted is false when an earlier run's token was reused.
	JoinTokenMinted bool
	// JoinTokenUses and JoinTokenMaxUses describe the join token.
	JoinTokenUses, JoinTokenMaxUses int32
	// FilesWritten lists the files Run changed (none on an idempotent
	// re-run).
	FilesWritten []string
}

// Exports returns the env file's content: export lines of the root tenant,
// root token and pool.
func (r Result) Exports() string {
	return fmt.Sprintf("export %s=%s\nexport %s=%s\nexport %s=%s\n",
		EnvTenant, r.TenantID, EnvToken, r.RootToken, EnvPool, r.PoolID)
}

// Announcement returns the export lines to print: the root token's only when
// this run minted it, so that the first start of a deployment prints its
// root token once and a re-run does not print it again (the env file keeps
// it for the dev stack).
func (r Result) Announcement() string {
	if r.RootTokenMinted {
		return r.Exports()
	}
	return fmt.Sprintf("export %s=%s\nexport %s=%s\n", EnvTenant, r.TenantID, EnvPool, r.PoolID)
}

// Run ensures the tenant, root token, site, pool and join token in one
// transaction, then writes the files whose content changed.
func Run(ctx context.Context, db *store.DB, o Options) (Result, error) {
	d := Defaults()
	fill := func(s *string, def string) {
		if *s == "" {
			*s = def
		}
	}
	fill(&o.TenantName, d.TenantName)
	fill(&o.SiteName, d.SiteName)
	fill(&o.PoolName, d.PoolName)
	fill(&o.JoinTokenFile, d.JoinTokenFile)
	fill(&o.EnvFile, d.EnvFile)
	if o.JoinMaxUses <= 0 {
		o.JoinMaxUses = d.JoinMaxUses
	}
	if o.JoinTTL <= 0 {
		o.JoinTTL = d.JoinTTL
	}

	oldEnv, err := readEnvFile(o.EnvFile)
	if err != nil {
		return Result{}, err
	}
	oldJoin, err := readOptional(o.JoinTokenFile)
	if err != nil {
		return Result{}, err
	}
	oldJoinSecret := strings.TrimSpace(string(oldJoin))

	var res Result
	err = db.InTx(ctx, func(tx pgx.Tx) error {
		res = Result{}
		now := db.Now()
		tenant, err := store.EnsureTenant(ctx, tx, store.Tenant{ID: ids.New(ids.Tenant, now), Name: o.TenantName, CreatedAt: now})
		if err != nil {
			return err
		}
		res.TenantID = tenant.ID
		site, err := store.EnsureSite(ctx, tx, store.Site{ID: ids.New(ids.Site, now), Name: o.SiteName, Region: o.Region, CreatedAt: now})
		if err != nil {
			return err
		}
		res.SiteID = site.ID
		pool, err := store.EnsurePool(ctx, tx, store.Pool{ID: ids.New(ids.Pool, now), SiteID: site.ID, OwnerTenantID: tenant.ID,
			Name: o.PoolName, Kind: "metal-host", AcceptanceCheck: "diag.nvml", GPUModel: o.GPUModel,
			ExpectGPUCount: o.ExpectGPUs, CreatedAt: now})
		if err != nil {
			return err
		}
		res.PoolID = pool.ID

		if res.RootToken, res.RootTokenMinted, err = ensureRootToken(ctx, tx, now, tenant.ID, oldEnv[EnvToken]); err != nil {
			return err
		}

		if oldJoinSecret != "" {
			jt, err := store.GetJoinTokenByHash(ctx, tx, iam.HashSecret(oldJoinSecret))
			switch {
			case err == nil && jt.PoolID == pool.ID && jt.RevokedAt == nil && jt.ExpiresAt.After(now) && jt.Uses < jt.MaxUses:
				res.JoinToken, res.JoinTokenID = oldJoinSecret, jt.ID
				res.JoinTokenUses, res.JoinTokenMaxUses = jt.Uses, jt.MaxUses
				return nil
			case err != nil && !errors.Is(err, store.ErrNotFound):
				return err
			}
		}
		secret, err := iam.NewSecret(iam.JoinTokenPrefix)
		if err != nil {
			return err
		}
		jt := store.JoinToken{ID: ids.New(ids.JoinToken, now), PoolID: pool.ID, Hash: iam.HashSecret(secret),
			MaxUses: o.JoinMaxUses, ExpiresAt: now.Add(o.JoinTTL), CreatedBy: "bootstrap", CreatedAt: now}
		if err := store.CreateJoinToken(ctx, tx, store.AllTenants, jt); err != nil {
			return err
		}
		res.JoinToken, res.JoinTokenID, res.JoinTokenMinted = secret, jt.ID, true
		res.JoinTokenMaxUses = jt.MaxUses
		return nil
	})
	if err != nil {
		return Result{}, fmt.Errorf("bootstrap: %w", err)
	}

	for _, f := range []struct {
		path    string
		content []byte
		mode    os.FileMode
	}{
		// Machines read the join token, as the same user.
		{o.JoinTokenFile, []byte(res.JoinToken + "\n"), 0o600},
		// The root-admin token: owner-only.
		{o.EnvFile, []byte(res.Exports()), 0o600},
	} {
		wrote, err := writeIfChanged(f.path, f.content, f.mode)
		if err != nil {
			return res, err
		}
		if wrote {
			res.FilesWritten = append(res.FilesWritten, f.path)
		}
	}
	return res, nil
}

// ensureRootToken returns secret when it is a live root-admin token of
// tenantID, else a new one (minted true).
func ensureRootToken(ctx context.Context, tx store.DBTX, now time.Time, tenantID, secret string) (string, bool, error) {
	if secret != "" && rootTokenValid(ctx, tx, secret, tenantID, now) {
		return secret, false, nil
	}
	token, _, err := iam.MintAPIToken(ctx, tx, now, tenantID, "bootstrap", iam.RoleRootAdmin, nil)
	return token, err == nil, err
}

// RootResult is what Root ensured.
type RootResult struct {
	// TenantID is the root tenant's id.
	TenantID string
	// RootToken is a root administrator's API token of that tenant (secret).
	RootToken string
	// RootTokenMinted is false when the token envFile held was reused.
	RootTokenMinted bool
}

// Root ensures the root tenant named tenantName (default "root") and a
// root-admin API token of it, in one transaction: the token envFile holds
// (BETTER_COMPUTE_TOKEN) is reused while it is valid, else a new one is
// minted and envFile is rewritten (mode 0600) with the tenant and token.
// It is the part of Run that `better-compute dev` and the dev stack need
// when they create pools and join tokens through the API themselves.
func Root(ctx context.Context, db *store.DB, tenantName, envFile string) (RootResult, error) {
	if tenantName == "" {
		tenantName = Defaults().TenantName
	}
	oldEnv, err := readEnvFile(envFile)
	if err != nil {
		return RootResult{}, err
	}
	var res RootResult
	err = db.InTx(ctx, func(tx pgx.Tx) error {
		now := db.Now()
		tenant, err := store.EnsureTenant(ctx, tx, store.Tenant{ID: ids.New(ids.Tenant, now), Name: tenantName, CreatedAt: now})
		if err != nil {
			return err
		}
		res.TenantID = tenant.ID
		res.RootToken, res.RootTokenMinted, err = ensureRootToken(ctx, tx, now, tenant.ID, oldEnv[EnvToken])
		return err
	})
	if err != nil {
		return RootResult{}, fmt.Errorf("bootstrap: %w", err)
	}
	content := fmt.Sprintf("export %s=%s\nexport %s=%s\n", EnvTenant, res.TenantID, EnvToken, res.RootToken)
	if _, err := writeIfChanged(envFile, []byte(content), 0o600); err != nil {
		return res, err
	}
	return res, nil
}

// rootTokenValid reports whether secret is a live root-admin token of
// tenantID.
func rootTokenValid(ctx context.Context, q store.DBTX, secret, tenantID string, now time.Time) bool {
	tok, err := store.GetAPITokenByHash(ctx, q, iam.HashSecret(secret))
	return err == nil && tok.TenantID == tenantID && tok.Role == string(iam.RoleRootAdmin) && tok.RevokedAt == nil &&
		(tok.ExpiresAt == nil || tok.ExpiresAt.After(now))
}

func readOptional(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return b, nil
}

// readEnvFile parses `export KEY=VALUE` (or KEY=VALUE) lines; a missing
// file is empty.
func readEnvFile(path string) (map[string]string, error) {
	b, err := readOptional(path)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(sc.Text()), "export "))
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			out[strings.TrimSpace(k)] = strings.Trim(strings.TrimSpace(v), `"'`)
		}
	}
	return out, sc.Err()
}

// writeIfChanged writes content to path atomically with mode unless the file
// already holds exactly that content and mode; it reports whether it wrote.
func writeIfChanged(path string, content []byte, mode os.FileMode) (bool, error) {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, content) {
		if st, err := os.Stat(path); err == nil && st.Mode().Perm() == mode {
			return false, nil
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return false, err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return false, err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(content); err != nil {
		tmp.Close()
		return false, err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return false, err
	}
	if err := tmp.Close(); err != nil {
		return false, err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return false, fmt.Errorf("write %s: %w", path, err)
	}
	return true, nil
}
