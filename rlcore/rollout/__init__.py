"""rollout wing."""
