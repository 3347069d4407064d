-- Capacity generations (docs/architecture.md, "Reservations"): the scheduler
-- keeps each pool's nodes and open bookings in memory and reads back only the
-- nodes whose capacity_generation moved since it read them
-- (store.PoolCapacitySince); a placement is written only onto nodes whose
-- generation, read under the node's lock, is the one the plan was made on
-- (store.PlaceReservationsAt).
--
-- capacity_generation moves, in the transaction that makes the change,
-- whenever what placement reads of a node changes:
--   - the node's row: its pool, provision state, revocation, cordon,
--     reachability, whether it holds a session, and its spec generation,
--     which every writer that places or ends a reservation bumps in the same
--     transaction (RebuildNodeSpecs), so bookings made or ended with a spec
--     rebuild need nothing more;
--   - its devices (node_devices rows inserted, updated or deleted) while it
--     is adopted;
--   - its bookings updated or deleted (a booking's end moved, a booking
--     dropped), whoever does it.
-- Each writer already holds the node's row (or takes it here) until it
-- commits, so a placement that locks the node reads the generation of the
-- last committed change. Bookings are inserted only with a spec rebuild
-- (PlaceReservations); a booking inserted alone (a test's fixture) does not
-- move the generation, and the bookings' exclusion constraint (I1) still
-- refuses a placement over it.
ALTER TABLE nodes ADD COLUMN capacity_generation bigint NOT NULL DEFAULT 0;

CREATE FUNCTION nodes_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.capacity_generation := OLD.capacity_generation + 1;
    RETURN NEW;
END
$$;

CREATE TRIGGER nodes_capacity_generation BEFORE UPDATE ON nodes FOR EACH ROW
    WHEN (OLD.pool_id IS DISTINCT FROM NEW.pool_id
        OR OLD.provision_state IS DISTINCT FROM NEW.provision_state
        OR OLD.revoked_at IS DISTINCT FROM NEW.revoked_at
        OR OLD.cordoned IS DISTINCT FROM NEW.cordoned
        OR OLD.reachable IS DISTINCT FROM NEW.reachable
        OR (OLD.session_id IS NULL) IS DISTINCT FROM (NEW.session_id IS NULL)
        OR OLD.spec_generation IS DISTINCT FROM NEW.spec_generation)
    EXECUTE FUNCTION nodes_capacity_generation();

-- One statement per triggering statement (transition tables), whatever the
-- number of rows, the nodes locked in id order first. The devices of a node
-- not yet adopted are no capacity: its adoption moves the generation.
CREATE FUNCTION node_devices_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM nodes WHERE id IN (SELECT node_id FROM changed_devices) AND provision_state = 'adopted'
    ORDER BY id FOR NO KEY UPDATE;
    UPDATE nodes SET capacity_generation = capacity_generation + 1
    WHERE id IN (SELECT node_id FROM changed_devices) AND provision_state = 'adopted';
    RETURN NULL;
END
$$;

CREATE TRIGGER node_devices_inserted_capacity_generation AFTER INSERT ON node_devices
    REFERENCING NEW TABLE AS changed_devices FOR EACH STATEMENT EXECUTE FUNCTION node_devices_capacity_generation();
CREATE TRIGGER node_devices_updated_capacity_generation AFTER UPDATE ON node_devices
    REFERENCING NEW TABLE AS changed_devices FOR EACH STATEMENT EXECUTE FUNCTION node_devices_capacity_generation();
CREATE TRIGGER node_devices_deleted_capacity_generation AFTER DELETE ON node_devices
    REFERENCING OLD TABLE AS changed_devices FOR EACH STATEMENT EXECUTE FUNCTION node_devices_capacity_generation();

-- A booking deleted with its reservation (retention deletes only reservations
-- that ended long ago, whose bookings ended with them) was no capacity, so
-- only bookings whose reservation is still there count. The nodes are locked
-- in id order first, as every other writer of several nodes locks them, so
-- that the trigger's statement does not deadlock with them.
CREATE FUNCTION bookings_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE TRIGGER bookings_updated_capacity_generation AFTER UPDATE ON bookings
    REFERENCING OLD TABLE AS changed_bookings FOR EACH STATEMENT EXECUTE FUNCTION bookings_capacity_generation();
CREATE TRIGGER bookings_deleted_capacity_generation AFTER DELETE ON bookings
    REFERENCING OLD TABLE AS changed_bookings FOR EACH STATEMENT EXECUTE FUNCTION bookings_capacity_generation();
