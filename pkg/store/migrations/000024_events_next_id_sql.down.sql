CREATE OR REPLACE FUNCTION events_next_id() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN nextval('events_id_seq'::regclass);
END
$$;
