"""Memory of the API refusing an hf-checkpoint archive whose extension header declares 1 GiB (issue 39, item 4).

Run from the repository root: ``python -m bench.archive_headers [--limit-mb 256]``.

The real app (SQLite ledger, local store) under Flask's test client, in this process: each archive of
:mod:`tests.fixtures.archive_bombs` (a ~1 MB gzip of a pax header declaring 1 GiB, a 1 MB plain tar whose pax or
GNU long-name header declares 1 GiB) is uploaded, then submitted and resolved as an hf-checkpoint model; both must
be a 422 naming the cap (:mod:`compilesvc.store.tar_caps`). The figure is the process's exact peak RSS growth over
the submit and the resolve (``/proc/self/clear_refs`` "5" resets VmHWM before; VmHWM minus the RSS then). Before
the caps the gzip one took ~1 GiB and many seconds. Exit status 1 if a refusal is missing or a growth passes the
limit.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
import time
from pathlib import Path

from bench._proc import status_kib
from bench._table import record

MB = 1000 * 1000


def _archives() -> dict[str, bytes]:
    from tests.fixtures.archive_bombs import pax_bomb, truncated_bomb

    return {"gzip pax header declaring 1 GiB": pax_bomb(),
            "tar pax header declaring 1 GiB": truncated_bomb(),
            "tar GNU long name declaring 1 GiB": truncated_bomb(kind=tarfile.GNUTYPE_LONGNAME)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--limit-mb", type=float, default=256.0)
    args = parser.parse_args(argv)

    from compilesvc.ledger.migrate import upgrade
    from compilesvc.services import Services
    from tests.fixtures.tokens import make_token
    from tests.web.support import make_settings
    from web.server.app import create_app

    ok = True
    with tempfile.TemporaryDirectory(prefix="archive-headers-") as scratch:
        url = f"sqlite:///{Path(scratch) / 'ledger.db'}"
        upgrade(url)
        services = Services.from_settings(make_settings(Path(scratch) / "env", url))
        try:
            app = create_app(services=services)
            client = app.test_client()
            client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {make_token(services.sessions, 'admin')}"
            for name, archive in _archives().items():
                uploaded = client.post("/v1/models", data=archive, content_type="application/octet-stream")
                spec = {"model": {"uri": uploaded.json["uri"], "format": "hf-checkpoint"},  # type: ignore[index]
                        "target": "trn2", "sdk": "2.29.0", "neuron_config": {"tp_degree": 8, "seq_len": 128}}
                Path("/proc/self/clear_refs").write_text("5")
                baseline = status_kib("VmRSS")
                started = time.perf_counter()
                answers = [client.post("/v1/builds?queue_anyway=true", json=spec),
                           client.post("/v1/artifacts/resolve", json=spec)]
                seconds = time.perf_counter() - started
                growth = (status_kib("VmHWM") - baseline) * 1024
                refused = all(a.status_code == 422 and "archive header cap" in json.dumps(a.json) for a in answers)
                ok = ok and refused
                figure = record("archive_headers", f"{len(archive) / MB:.2f} MB archive, {name}: the API process's "
                                f"peak RSS growth over a submit and a resolve", growth / MB, "MB",
                                at_most=args.limit_mb, vs="its RSS before the two requests (VmHWM reset)",
                                note=f"{'both 422 naming the cap' if refused else 'NOT REFUSED'}; {seconds:.2f} s")
                ok = ok and figure.met is not False
        finally:
            services.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
