"""Benchmarks that print ratios against a peer run side by side (not collected by pytest)."""
