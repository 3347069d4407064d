package store

import "github.com/jackc/pgx/v5/pgxpool"

// PendingSessionWorkSQL exposes PendingSessionWork's query to the plan test.
const PendingSessionWorkSQL = pendingSessionWorkSQL

// ClaimSessionDeliveriesSQL exposes ClaimSessionDeliveries' statement to the
// plan test.
const ClaimSessionDeliveriesSQL = claimSessionDeliveriesSQL

// EventOf exposes EventData's type and subject to the tests of the event
// data.
func EventOf(d EventData) (typ, subject string) { return d.event() }

// CommandEndedDataSQL exposes commandEndedDataSQL to its test.
const CommandEndedDataSQL = commandEndedDataSQL

// ScanEventsSQL exposes ScanEvents' statement for one tenant to the plan
// test.
const ScanEventsSQL = scanEventsSQL

// ReservationFailedDataSQL exposes reservationFailedDataSQL to its test.
const ReservationFailedDataSQL = reservationFailedDataSQL

// CreateReservationSQL exposes CreateReservation's statement to the
// statements test.
var CreateReservationSQL = createReservationSQL

// ScanAllEventsSQL exposes ScanEvents' statement for AllTenants to the plan
// test.
const ScanAllEventsSQL = scanAllEventsSQL

// GenericPool exposes the pool behind AutoCommit (its connections' settings:
// generic plans, no seq scans) to the plan tests, which PREPARE on one of its
// connections.
func (db *DB) GenericPool() *pgxpool.Pool { return db.generic }
