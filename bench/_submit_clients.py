"""Concurrent identical submits from several client processes (not a bench itself; used by bench.pipeline c.).

:func:`submit_all` starts ``processes`` copies of ``python -m bench._submit_clients``; each reads its order
(URL, headers, spec, how many submits) as one JSON line on stdin, starts one thread and one connection per
submit, says ``ready`` once every thread waits, and posts when it reads ``go``. The parent writes ``go`` to
every process only after all are ready: a barrier across processes, so the submits really arrive together.
Why processes: a few hundred threads in one interpreter on a small host would queue behind one GIL, and the
client, not the service, would decide how many requests are in flight. Each answer (or error) goes back as
one JSON line with the client's own clock around the request.

Imports only the standard library, so a client starts in a fraction of a second.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KEPT = ("build_id", "outcome", "artifact_key")  # what the parent reads of an answer


def submit_all(url: str, headers: dict[str, str], spec: dict[str, Any], n: int, processes: int,
               timeout: float) -> list[dict[str, Any]]:
    """``n`` POSTs of ``spec`` to ``url``, released together from ``processes`` client processes; one dict per
    submit: ``status``, ``body`` (:data:`KEPT`), ``sent``, ``answered`` (time.time()), or ``error``."""
    processes = max(1, min(processes, n))
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    clients = [subprocess.Popen([sys.executable, "-m", "bench._submit_clients"], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in shares]
    try:
        for client, share in zip(clients, shares, strict=True):
            assert client.stdin is not None
            order = {"url": url, "headers": headers, "spec": spec, "count": share, "timeout": timeout}
            client.stdin.write(json.dumps(order) + "\n")
            client.stdin.flush()
        for client in clients:
            assert client.stdout is not None
            line = client.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a submit client did not get ready: {line!r}")
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.close()
        results: list[dict[str, Any]] = []
        for client in clients:
            assert client.stdout is not None
            results += [json.loads(line) for line in client.stdout if line.strip()]
            if client.wait(timeout + 60) != 0:
                raise RuntimeError(f"a submit client exited {client.returncode}")
        return results
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()


def _client() -> int:
    order = json.loads(sys.stdin.readline())
    go = threading.Event()
    results: list[dict[str, Any]] = [{"error": "no answer"}] * order["count"]
    waiting = threading.Semaphore(0)
    url = urllib.parse.urlsplit(order["url"])
    target = url.path + (f"?{url.query}" if url.query else "")
    body = json.dumps(order["spec"]).encode()
    headers = {**order["headers"], "Content-Type": "application/json", "Host": url.netloc}

    def submit(index: int) -> None:
        # http.client, not requests: the clients share the host with the server, and requests' own work per
        # call would be counted in every latency and taken from the server.
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=order["timeout"])
        waiting.release()
        go.wait()
        sent = time.time()
        try:
            conn.request("POST", target, body=body, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            answered = time.time()
            json_body = response.getheader("Content-Type", "").startswith("application/json")
            parsed = json.loads(raw) if json_body else {"text": raw[:300].decode(errors="replace")}
            results[index] = {"status": response.status, "sent": sent, "answered": answered,
                              "body": {k: parsed[k] for k in KEPT if k in parsed} if response.status < 400 else parsed}
        except Exception as exc:  # reported to the parent, which counts it as a failed submit
            results[index] = {"error": repr(exc), "sent": sent, "answered": time.time()}
        finally:
            conn.close()

    threads = [threading.Thread(target=submit, args=(i,), daemon=True) for i in range(order["count"])]
    for thread in threads:
        thread.start()
    for _ in threads:
        waiting.acquire()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    go.set()
    for thread in threads:
        thread.join()
    for result in results:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_client())
