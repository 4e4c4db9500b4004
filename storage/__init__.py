"""Persistence: the SQL tables and their stores (tenants, keys, prices, ledger, batches)
and the quota stores on Redis or in memory."""
