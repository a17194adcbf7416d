"""compilesvc.dispatch.routing."""
