-- The capacity generation of the adopted nodes whose devices a statement
-- changed (migration 000021) moves in one statement that reaches the nodes
-- through their primary key: the distinct node ids of the transition table as
-- an array, the nodes locked in id order first (MATERIALIZED), then updated.
-- Written as `id IN (SELECT node_id FROM changed_devices)` the planner, which
-- costs a transition table at its row count (8 per machine), hash-joined it
-- with a scan of every node, twice per statement: each adoption batch read
-- the whole fleet four times.
CREATE OR REPLACE FUNCTION node_devices_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    WITH l AS MATERIALIZED (
        SELECT id FROM nodes
        WHERE id = ANY (ARRAY(SELECT DISTINCT node_id FROM changed_devices)) AND provision_state = 'adopted'
        ORDER BY id FOR NO KEY UPDATE)
    UPDATE nodes n SET capacity_generation = n.capacity_generation + 1 FROM l WHERE n.id = l.id;
    RETURN NULL;
END
$$;
