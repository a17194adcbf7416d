"""Keeping a compile, which runs the submitted model, away from everything else: the compiler child and
its process group, its environment allow-list, bubblewrap and its limits, and the pod split's spool between
the worker and its secret-less compile container (see docs/security.md).

May import the core's spec and pinning, and no other worker package (it runs the compile child by module
name); nothing that holds a service secret.
"""
