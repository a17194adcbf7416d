"""compilesvc.insights."""
