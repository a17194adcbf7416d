"""Celery worker side: the app, thin tasks, the compile runner and compiler backends."""
