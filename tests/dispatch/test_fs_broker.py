"""The embedded default's broker (compilesvc.dispatch.fs_broker): a consumer polling the queue while another process
sends never reads a message half written, and celery_config uses it for filesystem:// brokers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection

from compilesvc.config.settings import Settings
from compilesvc.dispatch import fs_broker
from compilesvc.dispatch.routing import celery_config

MESSAGES = 12

#: A producer process: large messages, so that each takes a while to encode and write, the window in which
#: kombu's own transport shows its consumer a message file that is still empty or partly written.
PRODUCER = """
import sys, json
from kombu import Connection
transport, folder, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {"data_folder_in": folder, "data_folder_out": folder}
with Connection("filesystem://", transport=transport or None, transport_options=options) as conn:
    for index in range(count):
        conn.default_channel._put("q", {"n": index, "pad": "x" * (16 << 20)})
"""


@pytest.mark.slow
def test_a_consumer_racing_a_producer_process_reads_every_message_whole(tmp_path: Path) -> None:
    options = {"data_folder_in": str(tmp_path), "data_folder_out": str(tmp_path), "store_processed": False}
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, fs_broker.TRANSPORT, str(tmp_path), str(MESSAGES)])
    got: list[int] = []
    with Connection("filesystem://", transport=fs_broker.TRANSPORT, transport_options=options) as conn:
        channel = conn.default_channel
        while len(got) < MESSAGES:  # kombu's own consumer step, as a worker runs it: list, move, read, decode
            try:
                got.append(channel._get("q")["n"])
            except Empty:
                assert producer.poll() in (None, 0), "the producer failed"
    assert producer.wait(60) == 0
    assert sorted(got) == list(range(MESSAGES))
    assert list(tmp_path.iterdir()) == []  # nothing half written left behind


def test_filesystem_brokers_use_it(tmp_path: Path) -> None:
    assert celery_config(Settings(data_dir=tmp_path))["broker_transport"] == fs_broker.TRANSPORT
    redis = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/0")  # type: ignore[arg-type]
    assert celery_config(redis)["broker_transport"] is None
