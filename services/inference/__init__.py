"""squall inference."""
