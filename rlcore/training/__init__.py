"""training wing."""
