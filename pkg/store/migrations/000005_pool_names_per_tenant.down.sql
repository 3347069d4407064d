ALTER TABLE pools DROP CONSTRAINT pools_site_owner_name_key;
ALTER TABLE pools ADD CONSTRAINT pools_site_id_name_key UNIQUE (site_id, name);
