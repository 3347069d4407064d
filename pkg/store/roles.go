package store

// The services' database roles: each service connects as its own role
// with only the privileges its queries need (roles.sql).

import (
	"context"
	"crypto/hmac"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	_ "embed" // roles.sql
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The services' roles, one per control-plane service. The owner of the
// schema (the role that runs the migrations: compose's migrate one-shot)
// keeps every privilege; `better-compute dev`, the bootstrap and the test
// suites connect as the owner.
const (
	RoleAPI         = "bc_api"
	RoleJoinService = "bc_joinservice"
	RoleGateway     = "bc_gateway"
	RoleScheduler   = "bc_scheduler"
	RoleControllers = "bc_controllers"
)

// Roles returns the services' roles, sorted.
func Roles() []string {
	return []string{RoleAPI, RoleControllers, RoleGateway, RoleJoinService, RoleScheduler}
}

// rolesSQL grants each role its privileges, one GRANT per table with the
// store functions that need it.
//
//go:embed roles.sql
var rolesSQL string

// setupRolesLock is the advisory lock that serializes SetupRoles runs on
// one database.
const setupRolesLock = 0x62635f726f6c6573 // "bc_roles"

// SetupRoles makes the services' roles what roles.sql says, in one
// transaction on db (connected as the schema's owner, with CREATEROLE):
//   - a role that does not exist is created NOLOGIN (roles are the
//     cluster's, so the databases of one cluster share them);
//   - every privilege a role holds on the tables and sequences of schema
//     public is revoked, then roles.sql grants what its service needs, so
//     that a privilege removed from the file is removed from the database;
//   - each role of logins (a role name to its password) gets LOGIN with that
//     password, sent as a SCRAM-SHA-256 verifier so that the password itself
//     never reaches the server (nor its logs); a role not in logins keeps its
//     LOGIN and password as they are.
//
// Errors: a role in logins that is not one of Roles, an empty password, the
// database's (permission denied without CREATEROLE or ownership of the
// tables).
func SetupRoles(ctx context.Context, db *DB, logins map[string]string) error {
	for role, pw := range logins {
		if !slices.Contains(Roles(), role) {
			return fmt.Errorf("setup roles: %q is not a service role (%s)", role, strings.Join(Roles(), ", "))
		}
		if pw == "" {
			return fmt.Errorf("setup roles: the password of %s is empty", role)
		}
	}
	// Roles are the cluster's and the lock below the database's: another
	// database setting the roles up at the same time may update a role's
	// row first, which fails this transaction (XX000 "tuple concurrently
	// updated", raised once the other committed); it runs again.
	var err error
	for range setupRolesAttempts {
		if err = setupRoles(ctx, db, logins); !concurrentlyUpdated(err) {
			return err
		}
	}
	return err
}

// setupRolesAttempts is how many times SetupRoles runs its transaction.
const setupRolesAttempts = 5

// concurrentlyUpdated reports whether err is PostgreSQL's refusal of a
// catalog update that another transaction's update of the same row beat.
func concurrentlyUpdated(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "XX000" && pgErr.Message == "tuple concurrently updated"
}

// setupRoles is one run of SetupRoles' transaction.
func setupRoles(ctx context.Context, db *DB, logins map[string]string) error {
	return db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(setupRolesLock)); err != nil {
			return fmt.Errorf("setup roles: %w", err)
		}
		for _, role := range Roles() {
			if err := createRole(ctx, tx, role); err != nil {
				return err
			}
		}
		names := make([]string, 0, len(Roles()))
		for _, role := range Roles() {
			names = append(names, pgx.Identifier{role}.Sanitize())
		}
		all := strings.Join(names, ", ")
		if _, err := tx.Exec(ctx, `REVOKE ALL ON ALL TABLES IN SCHEMA public FROM `+all+`;
			REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM `+all); err != nil {
			return fmt.Errorf("setup roles: revoke: %w", err)
		}
		if _, err := tx.Exec(ctx, rolesSQL); err != nil {
			return fmt.Errorf("setup roles: roles.sql: %w", err)
		}
		for _, role := range Roles() {
			pw, ok := logins[role]
			if !ok {
				continue
			}
			verifier, err := scramVerifier(pw)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `ALTER ROLE `+pgx.Identifier{role}.Sanitize()+` LOGIN PASSWORD '`+verifier+`'`); err != nil {
				return fmt.Errorf("setup roles: login of %s: %w", role, err)
			}
		}
		return nil
	})
}

// createRole creates role NOLOGIN unless it exists. Another database of
// the cluster may be creating it at the same time (SetupRoles' lock is
// the database's): its duplicate is taken as created.
func createRole(ctx context.Context, tx pgx.Tx, role string) error {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)`, role).Scan(&exists); err != nil {
		return fmt.Errorf("setup roles: %w", err)
	}
	if exists {
		return nil
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("setup roles: %w", err)
	}
	_, err = sp.Exec(ctx, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()+` NOLOGIN`)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42710" || pgErr.Code == "23505") { // duplicate_object, unique_violation
		return sp.Rollback(ctx)
	}
	if err != nil {
		_ = sp.Rollback(ctx)
		return fmt.Errorf("setup roles: create %s: %w", role, err)
	}
	return sp.Commit(ctx)
}

// scramIterations is the iteration count of the SCRAM-SHA-256 verifiers
// SetupRoles sets (PostgreSQL's default, scram_iterations).
const scramIterations = 4096

// scramVerifier returns the SCRAM-SHA-256 verifier of password as
// PostgreSQL stores it (RFC 5802 §3, RFC 7677):
// SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>, base64, with a
// random 16-byte salt. The password is used as given (PostgreSQL applies
// SASLprep, which changes nothing for ASCII passwords).
func scramVerifier(password string) (string, error) {
	salt := make([]byte, 16)
	if _, err := rand.Read(salt); err != nil {
		return "", err
	}
	salted, err := pbkdf2.Key(sha256.New, password, salt, scramIterations, sha256.Size)
	if err != nil {
		return "", err
	}
	mac := func(key []byte, msg string) []byte {
		h := hmac.New(sha256.New, key)
		h.Write([]byte(msg))
		return h.Sum(nil)
	}
	stored := sha256.Sum256(mac(salted, "Client Key"))
	b64 := base64.StdEncoding.EncodeToString
	return fmt.Sprintf("SCRAM-SHA-256$%d:%s$%s:%s", scramIterations, b64(salt), b64(stored[:]), b64(mac(salted, "Server Key"))), nil
}
