ALTER TABLE events ALTER COLUMN id SET DEFAULT nextval('events_id_seq'::regclass);
DROP FUNCTION events_next_id();
