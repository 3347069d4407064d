-- An event's id is taken after its transaction has a transaction id, so
-- that the events watch may read one tenant's rows only (pkg/store
-- ScanEvents, EventWriters; services/api WatchConfig).
--
-- The watch must never deliver an event while an event with a lower id may
-- still commit. It used to read every tenant's rows after its cursor to see
-- the gaps in the ids. Now it reads the caller's tenant's rows
-- (events_tenant_idx, (tenant_id, id)) with the transactions running at the
-- read's snapshot: an id below a committed one X was taken before X, so,
-- once taking an id gives the transaction its id first, the transaction
-- that took it either had ended by then (it rolled back) or is among those
-- running; the watch waits until none of those holds a lock on events any
-- more. With the plain nextval default the insert took its id before its
-- transaction id, and a transaction in that instant was in no snapshot.
--
-- pg_current_xact_id() assigns the transaction's id if it has none; plpgsql
-- runs the two statements in order. The insert has locked events (ROW
-- EXCLUSIVE, until its transaction ends) before it evaluates the default.
-- Setting the default takes ACCESS EXCLUSIVE on events, which waits for
-- every transaction that inserted into it, so no id taken the old way is
-- still uncommitted afterwards.
CREATE FUNCTION events_next_id() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN nextval('events_id_seq'::regclass);
END
$$;
ALTER TABLE events ALTER COLUMN id SET DEFAULT events_next_id();
