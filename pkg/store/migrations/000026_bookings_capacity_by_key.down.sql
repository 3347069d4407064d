CREATE OR REPLACE FUNCTION bookings_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM nodes WHERE id IN (
        SELECT b.node_id FROM changed_bookings b WHERE EXISTS (SELECT 1 FROM reservations r WHERE r.id = b.reservation_id))
    ORDER BY id FOR NO KEY UPDATE;
    UPDATE nodes SET capacity_generation = capacity_generation + 1
    WHERE id IN (
        SELECT b.node_id FROM changed_bookings b WHERE EXISTS (SELECT 1 FROM reservations r WHERE r.id = b.reservation_id));
    RETURN NULL;
END
$$;
