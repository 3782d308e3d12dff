"""squall monitor."""
