"""web.server."""
