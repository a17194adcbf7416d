"""What pool pre-ping costs the processes that use it (relay, reaper, workers): a worker's claim-sized
transaction with and without it, on the Postgres ledger, interleaved in one run.

    python -m bench.db_preping [--transactions 2000]

Pre-ping is one ``SELECT 1`` round trip per checkout. The API does not pay it (its hot path is a
single-digit-millisecond submit); the relay and workers run a few transactions a second and get, in exchange,
a claim that never fails on a connection that died with a database restart (tests/faults). Target: the extra
cost per transaction is under 1 ms, i.e. invisible next to a compile of minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sqlalchemy import select, text

from bench._table import record
from compilesvc.ledger.engine import make_engine, make_sessionmaker, transaction
from compilesvc.ledger.migrate import upgrade
from compilesvc.ledger.models import BucketCompile
from tests.fixtures.ledger import create_pg_database, drop_pg_database


def per_transaction_ms(sessions, n: int) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for _ in range(n):
        with transaction(sessions) as session:
            session.execute(select(BucketCompile.id).where(BucketCompile.id == 1).with_for_update())
    return (time.perf_counter() - started) / n * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    url = create_pg_database("compilesvc_bench_preping")
    try:
        upgrade(url)
        engines = {False: make_engine(url), True: make_engine(url, pool_pre_ping=True)}
        sessions = {flag: make_sessionmaker(engine) for flag, engine in engines.items()}
        for engine in engines.values():
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        samples: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits both alike
            for flag in (False, True):
                samples[flag].append(per_transaction_ms(sessions[flag], args.transactions))
        plain, pinged = (statistics.median(samples[flag]) for flag in (False, True))
        extra = pinged - plain
        print(f"claim-sized transaction: {plain:.3f} ms without pre-ping, {pinged:.3f} ms with "
              f"(+{extra:.3f} ms, {pinged / plain:.2f}x); target: under +1 ms -> {'PASS' if extra < 1 else 'MISS'}")
        record("db_preping", "pre-ping: extra time per claim-sized transaction", extra, "ms", at_most=1.0,
               vs="the same transaction without pre-ping, interleaved",
               note=f"{plain:.3f} ms -> {pinged:.3f} ms ({pinged / plain:.2f}x)")
        for engine in engines.values():
            engine.dispose()
        return 0 if extra < 1 else 1
    finally:
        drop_pg_database(url)


if __name__ == "__main__":
    raise SystemExit(main())
