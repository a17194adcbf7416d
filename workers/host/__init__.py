"""workers.host."""
