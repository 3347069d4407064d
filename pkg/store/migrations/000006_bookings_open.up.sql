-- Open bookings (docs/architecture.md, "Reservations"): the scheduler reads, every pass, the bookings
-- of a pool that have not ended (upper(during) > now). Bookings are kept
-- after their reservation ends (for usage), so without this index that read
-- scans the whole booking history.
CREATE INDEX bookings_upper_idx ON bookings (upper(during));
