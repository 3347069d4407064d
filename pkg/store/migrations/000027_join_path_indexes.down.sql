CREATE INDEX nodes_gateway_id_idx ON nodes (gateway_id) WHERE gateway_id IS NOT NULL;
CREATE INDEX node_certs_public_key ON node_certs (public_key_sha256);
