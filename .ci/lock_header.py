"""Put the project's header on requirements/server.lock after pip-compile writes it (`make lock`).

pip-compile writes its own header, which says neither what the lock is for nor where it holds, and rewrites the
file whole on every run (keeping other comments only sometimes); so the header goes in again each time, after
pip-compile's, replacing any older one.
"""

import sys
from pathlib import Path

HEADER = """\
# compilesvc's server dependency set (the `server` and `cpu` extras of pyproject.toml) at the versions that CI
# tests and docker/Dockerfile ships, every file hashed: `pip install --require-hashes -r requirements/server.lock`.
# For Linux x86_64 and CPython 3.11 (the python:3.11-slim image): torch is the +cpu build, whose one hash is
# the manylinux_2_28_x86_64 cp311 wheel of https://download.pytorch.org/whl/cpu. The ranges in pyproject.toml
# stay for library users; docker/Dockerfile.neuron takes the pins as constraints (docs/deploy.md#dependencies).
# Regenerate: `make lock` (keeps every pin it can), `make lock LOCK_ARGS=--upgrade`,
# `make lock LOCK_ARGS="--upgrade-package celery"`. Check the newest releases first: `make test-upstream`.
#
"""
MARK = "# compilesvc's server dependency set"


def main(path: str) -> None:
    lock = Path(path)
    lines = lock.read_text().splitlines(keepends=True)
    if any(line.startswith(MARK) for line in lines):  # an older header of ours: replaced, through its closing "#"
        start = next(i for i, line in enumerate(lines) if line.startswith(MARK))
        end = next(i for i in range(start, len(lines)) if lines[i] == "#\n")
        del lines[start:end + 1]
    # pip-compile's header is the leading run of comment lines; ours follows it, before the first requirement.
    end = 0
    while end < len(lines) and lines[end].startswith("#"):
        end += 1
    lock.write_text("".join(lines[:end]) + HEADER + "".join(lines[end:]))


if __name__ == "__main__":
    main(sys.argv[1])
