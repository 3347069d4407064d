-- Trust: node revocation and signed intent (issue "Trust and access",
-- items 4 and 5).
--
-- nodes.revoked_at is when an operator revoked the node (every certificate of
-- the node is revoked in the same transaction, node_certs.revoked_at); a
-- revoked node opens no session and renews no certificate.
ALTER TABLE nodes ADD COLUMN revoked_at timestamptz;

-- With signedIntent, every command and NodeSpec carries the command-signing
-- root's Ed25519 signature (RFC 8032) over exactly what the gateway sends:
-- pkg/pki CommandSigningInput / SpecSigningInput of the wire message. The
-- gateway relays it untouched; NULL when the deployment does not sign.
ALTER TABLE commands ADD COLUMN signature bytea;
ALTER TABLE nodes ADD COLUMN spec_signature bytea;

-- A signature belongs to one generation of one spec: an update that changes
-- the spec or its generation without setting a new signature clears the old
-- one, so a writer that forgets to sign delivers an unsigned spec (which
-- daemons requiring signed intent refuse and report) rather than a stale
-- signature.
CREATE FUNCTION nodes_clear_stale_spec_signature() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.spec_signature := NULL;
    RETURN NEW;
END;
$$;

CREATE TRIGGER nodes_spec_signature_stale
    BEFORE UPDATE OF spec, spec_generation ON nodes
    FOR EACH ROW
    WHEN ((NEW.spec IS DISTINCT FROM OLD.spec OR NEW.spec_generation IS DISTINCT FROM OLD.spec_generation)
          AND NEW.spec_signature IS NOT DISTINCT FROM OLD.spec_signature)
    EXECUTE FUNCTION nodes_clear_stale_spec_signature();
