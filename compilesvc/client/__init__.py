"""compilesvc.cli.connection."""
