"""The docs' command blocks and code samples, run as a user copies them (tests/docs/test_inventory.py lists
every block and what runs or checks it)."""
