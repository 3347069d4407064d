DROP TABLE IF EXISTS usage_windows;
DROP TABLE IF EXISTS bookings;
DROP TABLE IF EXISTS reservations;
DROP TABLE IF EXISTS pool_offers;
