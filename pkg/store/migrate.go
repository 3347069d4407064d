package store

// The embedded migrations and golang-migrate around them.

import (
	"embed"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/golang-migrate/migrate/v4"
	_ "github.com/golang-migrate/migrate/v4/database/pgx/v5" // registers pgx5://
	"github.com/golang-migrate/migrate/v4/source"
	"github.com/golang-migrate/migrate/v4/source/iofs"
)

// Migrations are the schema's migrations, NNNNNN_name.up.sql and .down.sql.
//
//go:embed migrations/*.sql
var Migrations embed.FS

func newMigrate(databaseURL string) (*migrate.Migrate, error) {
	m, _, err := newMigrateSource(databaseURL)
	return m, err
}

// newMigrateSource is newMigrate that also returns the embedded source.
func newMigrateSource(databaseURL string) (*migrate.Migrate, source.Driver, error) {
	files, err := iofs.New(Migrations, "migrations")
	if err != nil {
		return nil, nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	src := cleanMarking{files}
	u, err := url.Parse(databaseURL)
	if err != nil {
		return nil, nil, fmt.Errorf("parse database url: %w", err)
	}
	if u.Scheme == "postgres" || u.Scheme == "postgresql" {
		u.Scheme = "pgx5"
	}
	m, err := migrate.NewWithSourceInstance("iofs", src, u.String())
	if err != nil {
		return nil, nil, fmt.Errorf("open migrations: %w", err)
	}
	return m, src, nil
}

// cleanMarking is the embedded migrations, each up migration ending by
// marking its version clean: golang-migrate marks the schema dirty at N
// before it runs N, runs N's file as one statement batch (one transaction)
// and marks N clean after. A run killed between N's commit and that mark
// would leave N applied but dirty; with the mark inside N's transaction, a
// dirty N is always one that was rolled back, which MigrateUp runs again.
type cleanMarking struct{ source.Driver }

// ReadUp returns the up migration of version with the clean mark appended.
func (c cleanMarking) ReadUp(version uint) (io.ReadCloser, string, error) {
	r, id, err := c.Driver.ReadUp(version)
	if err != nil {
		return nil, id, err
	}
	mark := strings.NewReader(fmt.Sprintf("\n;\nUPDATE schema_migrations SET dirty = false WHERE version = %d;\n", version))
	return struct {
		io.Reader
		io.Closer
	}{io.MultiReader(r, mark), r}, id, nil
}

// MigrateUp applies every pending migration. No change is success.
//
// Each migration runs as one statement batch, so in one transaction, which
// also marks it clean (cleanMarking): a run killed half-way through
// migration N rolled N back and left the schema marked dirty at N. Such a
// migration is run again; if it fails again (a schema left dirty by another
// tool), the error says how to mark it by hand (MigrateForce) once its state
// is known.
func MigrateUp(databaseURL string) error {
	m, src, err := newMigrateSource(databaseURL)
	if err != nil {
		return err
	}
	defer m.Close()
	v, dirty, err := m.Version()
	if err != nil && !errors.Is(err, migrate.ErrNilVersion) {
		return fmt.Errorf("migrate up: %w", err)
	}
	if dirty {
		prev := -1 // none before the first
		if p, err := src.Prev(v); err == nil {
			prev = int(p)
		} else if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("migrate up: %w", err)
		}
		if err := m.Force(prev); err != nil {
			return fmt.Errorf("migrate up: retrying interrupted migration %d: %w", v, err)
		}
		if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
			return fmt.Errorf("migrate up: migration %d was interrupted and running it again failed (if it was applied after all, mark it so with `better-compute migrate force %d`): %w", v, v, err)
		}
		return nil
	}
	if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
		return fmt.Errorf("migrate up: %w", err)
	}
	return nil
}

// MigrateForce marks the schema as being at version (clean) without running
// anything: for an operator who repaired a failed migration by hand. Version
// 0 means no migration applied. It fails for a version that is not one of
// the embedded migrations.
func MigrateForce(databaseURL string, version uint) error {
	m, src, err := newMigrateSource(databaseURL)
	if err != nil {
		return err
	}
	defer m.Close()
	target := -1
	if version > 0 {
		if _, _, err := src.ReadUp(version); err != nil {
			return fmt.Errorf("migrate force: %d is not a migration version", version)
		}
		target = int(version)
	}
	if err := m.Force(target); err != nil {
		return fmt.Errorf("migrate force: %w", err)
	}
	return nil
}

// MigrateDown reverts steps migrations (all of them when steps <= 0). It
// refuses, changing nothing, when steps is more than the number of applied
// migrations or the schema is dirty.
func MigrateDown(databaseURL string, steps int) error {
	m, err := newMigrate(databaseURL)
	if err != nil {
		return err
	}
	defer m.Close()
	if steps > 0 {
		applied, err := appliedCount(m)
		if err != nil {
			return err
		}
		if steps > applied {
			return fmt.Errorf("migrate down: %d steps asked but only %d migrations are applied (nothing reverted)", steps, applied)
		}
	}
	if steps <= 0 {
		err = m.Down()
	} else {
		err = m.Steps(-steps)
	}
	if err != nil && !errors.Is(err, migrate.ErrNoChange) {
		return fmt.Errorf("migrate down: %w", err)
	}
	return nil
}

// MigrationVersion returns the applied version and whether it is dirty;
// version 0 means none applied.
func MigrationVersion(databaseURL string) (uint, bool, error) {
	m, err := newMigrate(databaseURL)
	if err != nil {
		return 0, false, err
	}
	defer m.Close()
	v, dirty, err := m.Version()
	if errors.Is(err, migrate.ErrNilVersion) {
		return 0, false, nil
	}
	return v, dirty, err
}

// Redact hides the password of a database URL for logs.
func Redact(databaseURL string) string {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return strings.SplitN(databaseURL, "@", 2)[len(strings.SplitN(databaseURL, "@", 2))-1]
	}
	return u.Redacted()
}

// appliedCount returns how many embedded migrations are applied: those with a
// version up to the database's. A dirty schema is an error.
func appliedCount(m *migrate.Migrate) (int, error) {
	v, dirty, err := m.Version()
	if errors.Is(err, migrate.ErrNilVersion) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if dirty {
		return 0, fmt.Errorf("migrate down: schema version %d is dirty; fix it by hand first", v)
	}
	entries, err := Migrations.ReadDir("migrations")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".up.sql") {
			continue
		}
		num, _, _ := strings.Cut(name, "_")
		ver, err := strconv.ParseUint(num, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("migration %s: %w", name, err)
		}
		if uint(ver) <= v {
			n++
		}
	}
	return n, nil
}
