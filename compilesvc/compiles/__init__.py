"""compilesvc.compiles."""
