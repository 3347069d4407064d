// Package storetest gives tests a real, migrated PostgreSQL database of their
// own. The server is BETTER_COMPUTE_TEST_DATABASE_URL when set (any database
// on it; the user must be allowed to CREATE DATABASE), otherwise one
// container per test process started with testcontainers-go from the locally
// built image BETTER_COMPUTE_POSTGRES_IMAGE (default
// better-compute/postgres:15; `make images` builds it). Set
// TESTCONTAINERS_RYUK_DISABLED=true: Ryuk's image cannot be pulled here, so
// the container is terminated by Stop (call it from TestMain). With
// BETTER_COMPUTE_TEST_POSTGRES_STATEMENTS=1 the container's server loads
// pg_stat_statements (shared_preload_libraries), for benchmarks that read
// what each statement cost (StatementsPreload).
//
// Each call of New creates a fresh database from a template migrated once, so
// tests can run in parallel without seeing each other's rows. Tests put rows
// in it with the factory (Tenant, Pool, Node, Command, Reservation, …; see
// factory.go), not with SQL of their own, and a fleet of adopted nodes with
// NewFleet.
package storetest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
)

var (
	// templateDB is the migrated template every test database copies.
	templateDB  string
	once        sync.Once
	serverURL   string
	setupErr    error
	pgContainer testcontainers.Container
	counter     atomic.Int64
)

// StatementsPreload reports whether the container's server is started with
// pg_stat_statements loaded: BETTER_COMPUTE_TEST_POSTGRES_STATEMENTS=1.
func StatementsPreload() bool { return os.Getenv("BETTER_COMPUTE_TEST_POSTGRES_STATEMENTS") == "1" }

// Image is the Postgres image used when BETTER_COMPUTE_TEST_DATABASE_URL is unset.
func Image() string {
	if v := os.Getenv("BETTER_COMPUTE_POSTGRES_IMAGE"); v != "" {
		return v
	}
	return "better-compute/postgres:15"
}

func setup() {
	ctx := context.Background()
	serverURL = os.Getenv("BETTER_COMPUTE_TEST_DATABASE_URL")
	if serverURL == "" {
		UseLocalDocker()
		opts := []testcontainers.ContainerCustomizer{
			postgres.WithDatabase("bc"), postgres.WithUsername("bc"), postgres.WithPassword("bc"),
			postgres.BasicWaitStrategies(),
			testcontainers.WithEnv(map[string]string{"TZ": "UTC"}),
			LoopbackPorts("5432/tcp"),
		}
		if StatementsPreload() {
			opts = append(opts, testcontainers.WithCmdArgs("-c", "shared_preload_libraries=pg_stat_statements"))
		}
		c, err := postgres.Run(ctx, Image(), opts...)
		if err != nil {
			setupErr = fmt.Errorf("start postgres container from %s (run `make images`): %w", Image(), err)
			return
		}
		pgContainer = c
		serverURL, err = c.ConnectionString(ctx, "sslmode=disable")
		if err != nil {
			setupErr = err
			return
		}
	}
	conn, err := connect(ctx, serverURL)
	if err != nil {
		setupErr = err
		return
	}
	defer conn.Close(ctx)
	// A lock keeps parallel test processes from racing on the template.
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(424242)`); err != nil {
		setupErr = err
		return
	}
	defer func() { _, _ = conn.Exec(ctx, `SELECT pg_advisory_unlock(424242)`) }()
	// The template is named after the migrations it holds and never dropped:
	// other test processes may be copying it right now. It is built under a
	// temporary name and renamed once migrated, so it is never seen half-made.
	templateDB = templateName()
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, templateDB).Scan(&exists); err != nil {
		setupErr = err
		return
	}
	if exists {
		return
	}
	building := templateDB + "_building"
	_, _ = conn.Exec(ctx, `DROP DATABASE IF EXISTS `+building+` WITH (FORCE)`)
	if _, err := conn.Exec(ctx, `CREATE DATABASE `+building); err != nil {
		setupErr = fmt.Errorf("create template database: %w", err)
		return
	}
	if err := store.MigrateUp(withDB(serverURL, building)); err != nil {
		setupErr = err
		return
	}
	for attempt := 0; ; attempt++ {
		_, err := conn.Exec(ctx, `ALTER DATABASE `+building+` RENAME TO `+templateDB)
		// The migrator's connection may still be closing; retry.
		if err == nil || attempt > 50 || !strings.Contains(err.Error(), "being accessed by other users") {
			if err != nil {
				setupErr = fmt.Errorf("rename template database: %w", err)
			}
			return
		}
		_ = clock.Sleep(ctx, clock.New(), 100*time.Millisecond)
	}
}

// templateName names the template after a hash of the embedded migrations.
func templateName() string {
	h := sha256.New()
	entries, _ := fs.ReadDir(store.Migrations, "migrations")
	for _, e := range entries {
		b, _ := fs.ReadFile(store.Migrations, "migrations/"+e.Name())
		h.Write([]byte(e.Name()))
		h.Write(b)
	}
	return "bc_template_" + hex.EncodeToString(h.Sum(nil))[:16]
}

func connect(ctx context.Context, u string) (*pgx.Conn, error) {
	clk := clock.New()
	deadline := clk.Now().Add(30 * time.Second)
	for {
		conn, err := pgx.Connect(ctx, u)
		if err == nil {
			return conn, nil
		}
		if clk.Now().After(deadline) {
			return nil, err
		}
		_ = clock.Sleep(ctx, clk, 200*time.Millisecond)
	}
}

func withDB(u, db string) string {
	p, err := url.Parse(u)
	if err != nil {
		panic(err)
	}
	p.Path = "/" + db
	return p.String()
}

// ServerURL returns the URL of the test server's maintenance database,
// starting the server on first use.
func ServerURL(t testing.TB) string {
	t.Helper()
	once.Do(setup)
	if setupErr != nil {
		t.Fatalf("storetest: %v", setupErr)
	}
	return serverURL
}

// NewURL creates an empty, migrated database and returns its URL. It is
// dropped when the test ends.
func NewURL(t testing.TB) string {
	t.Helper()
	u := ServerURL(t)
	ctx := context.Background()
	name := fmt.Sprintf("bct_%d_%d", os.Getpid(), counter.Add(1))
	conn, err := connect(ctx, u)
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	defer conn.Close(ctx)
	for attempt := 0; ; attempt++ {
		_, err = conn.Exec(ctx, `CREATE DATABASE `+name+` TEMPLATE `+templateDB)
		// The template is busy while another test copies it; retry.
		if err == nil || attempt > 50 || !strings.Contains(err.Error(), "being accessed by other users") {
			break
		}
		_ = clock.Sleep(ctx, clock.New(), 100*time.Millisecond)
	}
	if err != nil {
		t.Fatalf("storetest: create database: %v", err)
	}
	t.Cleanup(func() {
		c, err := connect(context.Background(), u)
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		_, _ = c.Exec(context.Background(), `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`)
	})
	return withDB(u, name)
}

// New returns a store.DB on a fresh migrated database with clk (the real
// clock when nil), closed when the test ends.
func New(t testing.TB, clk clock.Clock) *store.DB {
	t.Helper()
	if clk == nil {
		clk = clock.New()
	}
	db, err := store.Open(context.Background(), NewURL(t), clk, 30*time.Second, store.Options{QueryTracer: statements})
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	t.Cleanup(db.Close)
	return db
}

// Stop terminates the container started for this process, if any. Call it at
// the end of TestMain.
func Stop() {
	if pgContainer != nil {
		_ = pgContainer.Terminate(context.Background())
	}
}
