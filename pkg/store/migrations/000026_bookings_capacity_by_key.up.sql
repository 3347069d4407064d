-- The capacity generation of the nodes whose bookings a statement ended
-- (migration 000021) moves in one statement that reaches the nodes through
-- their primary key, as migration 000025 does for devices: the distinct node
-- ids of the transition table as an array, the nodes locked in id order
-- first (MATERIALIZED), then updated. Written as `id IN (SELECT …)`, the
-- planner hash-joined the transition table with a scan of every node, twice
-- per release or expiry.
CREATE OR REPLACE FUNCTION bookings_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    WITH l AS MATERIALIZED (
        SELECT id FROM nodes
        WHERE id = ANY (ARRAY(SELECT DISTINCT b.node_id FROM changed_bookings b
            WHERE EXISTS (SELECT 1 FROM reservations r WHERE r.id = b.reservation_id)))
        ORDER BY id FOR NO KEY UPDATE)
    UPDATE nodes n SET capacity_generation = n.capacity_generation + 1 FROM l WHERE n.id = l.id;
    RETURN NULL;
END
$$;
