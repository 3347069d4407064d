DROP INDEX IF EXISTS tenants_parent_id_idx;
DROP INDEX IF EXISTS api_tokens_tenant_id_idx;
DROP TABLE IF EXISTS audit;
