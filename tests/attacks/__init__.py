"""The attack suite of issue 25: hostile models submitted through the real API with one team's ``submit``
token, against a real stack in both layouts (:mod:`tests.attacks.stack`: the embedded default, and
Postgres + Redis + S3), compiled together so they run in parallel.

What is attacked (:mod:`tests.attacks.payloads` says what a TorchScript model can do: its ``forward`` runs
during the compile, and ``torch.from_file`` maps any file the process can open, read-only or shared):

1. reads: the embedded default's admin token and URL-signing key, any private key in the data dir (the
   key that signs published artifacts, where it is kept there), its SQLite ledger (directly and
   through ``/proc/<worker>/cwd``), the worker's ``~/.aws/credentials`` (directly and through
   ``/proc/<worker>/root``), ``/proc/self/environ``, ``/proc/1/environ`` and the worker's
   ``/proc/<pid>/environ``, and another team's uploaded model, published model file and manifest in the
   local store; what was read is raised in the compile error or saved into the published artifact;
2. writes (``from_file(..., shared=True)``): another team's published manifest and blobs, the worker's
   credentials file, signing key and ledger, a file of the toolchain (every later compile's code), and the request and
   model of another compile running at the same time;
3. limits: an endless loop (time), a huge allocation (``COMPILESVC_SANDBOX_MEMORY_MB``), one file past
   ``COMPILESVC_SANDBOX_MAX_FILE_MB`` and files filling past ``COMPILESVC_SANDBOX_MAX_DISK_MB`` (small limits
   for the suite; it writes about 40 MiB in all).

What must hold for every attack: the build fails as a compile error, a ``SANDBOX_*_LIMIT`` compile error or
``timeout`` (never ``infra``), or succeeds harmlessly; no secret value (tokens, keys, credentials, the
ledger's bytes, the other team's model) appears in any answer the attacker gets: the build JSON,
``/v1/builds/{id}/logs``, the UI's build page and ``log.txt``, the archived log and every file of an
artifact the attack managed to publish; the other team's artifact bytes and manifest, the worker's files
and the running compile's files hash the same before and after; the worker is alive and compiles a benign
model afterwards. Two controls read a toolchain file the sandbox does show, through the same two channels,
and prove that what a read gets does come out, so "nothing leaked" means the sandbox stopped the read.

What TorchScript cannot do at all: open a socket, fork or exec a process, list a directory, or read a file
of no stated size (so ``/proc/*/environ`` is out of its reach even unsandboxed: those attacks stay, as the
record that they fail). Network, fork-bomb and ``/proc`` visibility payloads are plain Python run inside
the sandbox: tests/workers/isolation/test_sandbox.py covers them at the sandbox level.
"""
