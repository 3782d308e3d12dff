"""squall scheduler."""
