"""web.contract."""
