DROP INDEX IF EXISTS bookings_upper_idx;
