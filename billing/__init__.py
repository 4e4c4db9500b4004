"""Tenants, keys, plans and limits, price book, usage ledger, reports; SQL and Redis."""
