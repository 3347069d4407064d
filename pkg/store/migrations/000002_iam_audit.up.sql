-- IAM and audit: the audit log of mutating API calls, and the indexes that
-- list a tenant's tokens and child tenants.

-- audit has one row per mutating API call, refused ones included: who
-- (tenant, token, role: NULL for an unauthenticated caller), what (the
-- Connect procedure and the id of the resource acted on), when, and the
-- outcome ("ok" or the Connect code in snake_case, with the error message as
-- detail). Rows outlive the tenants and tokens they name: no foreign keys.
CREATE TABLE audit (
    id         bigserial PRIMARY KEY,
    at         timestamptz NOT NULL,
    tenant_id  text,
    token_id   text,
    role       text NOT NULL DEFAULT '',
    procedure  text NOT NULL,
    target     text NOT NULL DEFAULT '',
    outcome    text NOT NULL CHECK (outcome <> ''),
    detail     text NOT NULL DEFAULT ''
);
-- A tenant's rows newest first (ListAudit pages by descending id).
CREATE INDEX audit_tenant_id_idx ON audit (tenant_id, id DESC);

CREATE INDEX api_tokens_tenant_id_idx ON api_tokens (tenant_id, created_at);
CREATE INDEX tenants_parent_id_idx ON tenants (parent_id) WHERE parent_id IS NOT NULL;
