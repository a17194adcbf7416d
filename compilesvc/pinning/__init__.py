"""compilesvc.pinning."""
