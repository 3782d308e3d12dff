"""squall tools."""
