CREATE OR REPLACE FUNCTION node_devices_capacity_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM nodes WHERE id IN (SELECT node_id FROM changed_devices) AND provision_state = 'adopted'
    ORDER BY id FOR NO KEY UPDATE;
    UPDATE nodes SET capacity_generation = capacity_generation + 1
    WHERE id IN (SELECT node_id FROM changed_devices) AND provision_state = 'adopted';
    RETURN NULL;
END
$$;
