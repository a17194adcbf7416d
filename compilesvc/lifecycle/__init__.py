"""compilesvc.lifecycle."""
