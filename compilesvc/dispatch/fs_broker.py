"""The broker of the embedded default (``filesystem://``): kombu's filesystem transport, with message files
that appear whole.

kombu writes a message by opening its final name and then writing it, under a lock its consumer never takes:
the consumer moves any file with the queue's name away and reads it, so one caught between the open and the
write is read empty, and the worker dies on the JSON (seen in CI: ``compilesvc dev``'s worker exited with
``JSONDecodeError: Expecting value`` while the demo's builds were sent). Here the message is written under
a name the consumer does not look at and renamed into place, which is atomic within a directory.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

#: What celery_config names as the transport of a ``filesystem://`` broker.
TRANSPORT = "compilesvc.dispatch.fs_broker:Transport"


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]  # as kombu's
        """Put ``payload`` onto ``queue``: written under a hidden name, then renamed to kombu's."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # kombu's consumer takes files whose name after the first dot is "<queue>.msg"; this one's is not.
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        try:
            with open(partial, "wb") as out:
                out.write(dumps(payload).encode())  # type: ignore[no-untyped-call]  # kombu's, as kombu's _put
            os.replace(partial, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
