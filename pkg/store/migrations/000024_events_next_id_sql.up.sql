-- events_next_id() (migration 000017) as a SQL function: the planner inlines
-- it into the insert's default instead of calling PL/pgSQL for every event
-- row (its two statements cost an interpreter call and two expression
-- evaluations per row: about 1.5 µs of an event insert's 3.5).
--
-- The order stays the one the events watch relies on: CASE evaluates its
-- WHEN before its THEN, so pg_current_xact_id() gives the transaction its id
-- before nextval takes the event's. Both are volatile, so the planner folds
-- neither.
CREATE OR REPLACE FUNCTION events_next_id() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval('events_id_seq'::regclass) END
$$;
