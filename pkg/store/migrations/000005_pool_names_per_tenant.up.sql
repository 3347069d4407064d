-- A pool's name is unique among its owner tenant's pools of a site, not
-- among every tenant's: a tenant creating a pool must not learn the names
-- of other tenants' pools from an AlreadyExists.
ALTER TABLE pools DROP CONSTRAINT pools_site_id_name_key;
ALTER TABLE pools ADD CONSTRAINT pools_site_owner_name_key UNIQUE (site_id, owner_tenant_id, name);
