"""squall runner."""
