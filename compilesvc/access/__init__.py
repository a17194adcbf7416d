"""compilesvc.access."""
