-- JoinService finds the node a public key joined as (a Join retried after
-- its response was lost, or by a machine restarted mid-join, answers with
-- that node instead of making another): node_certs by public key.
CREATE INDEX node_certs_public_key ON node_certs (public_key_sha256);
