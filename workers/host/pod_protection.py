"""While it compiles, a worker on Kubernetes asks to be spared: annotations on its own pod.

- ``controller.kubernetes.io/pod-deletion-cost``: when a Deployment scales in (KEDA lowering its replicas),
  the ReplicaSet deletes the pods of lowest cost first (Kubernetes docs, "ReplicaSet", Pod deletion cost).
  A busy worker's cost is its running compiles; an idle one's is 0, so idle workers go first. The docs ask
  that it not be updated often: it changes only when a compile starts or ends.
- ``karpenter.sh/do-not-disrupt: "true"``: Karpenter does not consolidate or drift a node while a pod on it
  carries it (Karpenter docs, "Disruption", Pod-level controls). Set while compiling, removed when idle, so
  an idle worker's node can still be reclaimed.

Neither stops an involuntary end (a spot interruption, a node failure, a Karpenter NodePool's
``terminationGracePeriod``): those are the drain's job (:mod:`workers.compiling.drain`).

The worker needs ``POD_NAME`` and ``POD_NAMESPACE`` (the downward API) and a service-account token allowed
to patch pods; the Helm chart mounts one into the worker container only (never the compile container).
A patch that fails is logged and tried again every few seconds: it never delays or fails a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from typing import Any

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
FIELD_MANAGER = "compilesvc-worker"
#: How soon a patch that failed is tried again (while the pod does not carry the wanted state).
RETRY_SECONDS = 10.0


def pod_annotations(running: int) -> dict[str, str | None]:
    """What the pod carries with ``running`` compiles (None removes an annotation: JSON merge patch)."""
    return {DELETION_COST: str(running), DO_NOT_DISRUPT: "true" if running else None}


class PodProtection:
    """Counts this worker's running compiles and keeps its pod's annotations in step, from a thread of its
    own (the Kubernetes API may be slow or away; a compile never waits for it)."""

    def __init__(self, pod: str, namespace: str, client: Any = None):
        self.pod = pod
        self.namespace = namespace
        self._client = client
        self._lock = threading.Lock()
        self._running = 0
        self._changes: queue.Queue[int] = queue.Queue()
        self.applied: int | None = None
        self.thread = threading.Thread(target=self._run, name="pod-protection", daemon=True)

    @classmethod
    def from_environment(cls) -> PodProtection:
        """The pod this process runs in (``POD_NAME``, ``POD_NAMESPACE``); ValueError naming what is missing."""
        missing = [name for name in ("POD_NAME", "POD_NAMESPACE") if not os.environ.get(name)]
        if missing:
            raise ValueError(f"COMPILESVC_KUBERNETES_PROTECT needs {' and '.join(missing)} (the downward API: "
                             "docs/kubernetes.md)")
        return cls(os.environ["POD_NAME"], os.environ["POD_NAMESPACE"])

    def start(self) -> PodProtection:
        self._changes.put(0)  # a restarted worker's pod starts unprotected
        self.thread.start()
        return self

    def started(self) -> None:
        self._change(+1)

    def ended(self) -> None:
        self._change(-1)

    def _change(self, delta: int) -> None:
        with self._lock:
            self._running = max(self._running + delta, 0)
            self._changes.put(self._running)

    def _run(self) -> None:
        wanted: int | None = None
        while True:
            # Wait for a change; while the pod does not carry the wanted state yet, try again now and then.
            with contextlib.suppress(queue.Empty):
                wanted = self._changes.get(timeout=None if wanted == self.applied else RETRY_SECONDS)
                while not self._changes.empty():  # only the latest state matters
                    wanted = self._changes.get_nowait()
            if wanted is not None and wanted != self.applied:
                self._apply(wanted)

    def _apply(self, running: int) -> None:
        from lightkube import Client
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType

        try:
            if self._client is None:
                # In the pod: the mounted service-account token, CA and namespace (re-read as the token rotates);
                # elsewhere KUBECONFIG.
                self._client = Client(field_manager=FIELD_MANAGER)
            self._client.patch(Pod, self.pod, {"metadata": {"annotations": pod_annotations(running)}},
                               namespace=self.namespace, patch_type=PatchType.MERGE)
        except Exception as exc:  # the API is away or refuses: the next change tries again
            log.warning("could not annotate the pod", extra={"pod": self.pod, "running": running,
                                                              "error": f"{type(exc).__name__}: {exc}"})
            return
        self.applied = running
        log.info("pod protection", extra={"pod": self.pod, "running": running})
