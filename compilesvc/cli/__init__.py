"""compilesvc.cli.main."""
