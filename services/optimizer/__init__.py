"""Algorithms that optimise a run's resources rather than its weights (`squall optimize`)."""
