"""workers.compiling."""
