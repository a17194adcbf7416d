"""compilesvc.builds."""
