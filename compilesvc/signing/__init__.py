"""compilesvc.signing.keys."""
