-- A command's result is compressed with lz4 instead of pglz. PostgreSQL
-- compresses a row's largest values when the row is over its TOAST
-- threshold (2 kB), which a result takes a command's row over when the
-- terminal update writes it: a logs.collect's output (up to 256 KiB), and a
-- diag.nvml result of 8 GPUs (1.7 kB of jsonb) with a signed command's other
-- columns. lz4 takes about half of pglz's CPU for such a result, and far
-- less for a large one. Rows written before keep pglz, which reads as it did.
--
-- A server built without lz4 refuses the method (feature_not_supported):
-- it keeps pglz.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE commands ALTER COLUMN result SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported THEN
    NULL;
END
$$;
