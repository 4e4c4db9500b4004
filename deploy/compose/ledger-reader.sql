-- The role Grafana's ledger datasource logs in as (deploy/grafana/provisioning/datasources):
-- SELECT on the two tables its panels read, nothing else. Run by docker-compose.yml's
-- `ledger-reader` once `sluice migrate` created them; safe to run again.
-- psql -v reader_password=… -f ledger-reader.sql
SELECT 'CREATE ROLE grafana_reader LOGIN'
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'grafana_reader')
\gexec
ALTER ROLE grafana_reader WITH LOGIN PASSWORD :'reader_password';
GRANT SELECT ON usage_ledger, tenants TO grafana_reader;
