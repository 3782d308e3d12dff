"""squall trainer."""
