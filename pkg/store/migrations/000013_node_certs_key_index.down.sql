DROP INDEX node_certs_public_key;
