"""compilesvc.notify."""
