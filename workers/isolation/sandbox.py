"""The compile sandbox: the compiler child runs inside bubblewrap, as another user, seeing only its toolchain,
its own model and inputs, and writing only its own directories.

A compile runs the model (TorchScript and exported programs run code when they load and trace; the
toolchain itself parses what the model hands it), so the child is treated as hostile. Each child gets:

- **its own namespaces** (``--unshare-all``): user, PID (it sees and can signal only its own processes),
  network (a loopback of its own, for NxD's per-rank rendezvous; nothing else), IPC, UTS, cgroup; no
  nested user namespaces (``--disable-userns``), no capabilities, a new session (no terminal injection),
  and death with the worker (``--die-with-parent``, and PR_SET_PDEATHSIG on bubblewrap itself);
- **a filesystem of its own**: a fresh tmpfs root holding read-only binds of the toolchain
  (:func:`toolchain_paths`: the interpreter, the virtualenv, the ``compilesvc`` and ``workers`` package
  directories and nothing else of a checkout, ``/usr``, the dynamic loader's cache, the CPU topology in
  ``/sys``, the operator's extra read paths), the attempt's model and request read-only, and its work and
  output directories writable; a private ``/tmp`` and ``/dev/shm`` of bounded size; ``/dev`` with only
  the standard nodes plus the host's Neuron devices (``/dev/neuron*``), bound one by one;
- **another user**: a worker running as root starts bubblewrap as :attr:`Policy.user` (``nobody`` by
  default), after opening every source path itself, so the sandbox user needs no access to where the
  toolchain lives (binds are made from those descriptors, ``--ro-bind-fd``). A worker that is not root
  cannot switch users: the child then runs under the worker's uid outside, inside a user namespace
  (docs/security.md says what that means);
- **limits** (:class:`Limits`): address space, processes, open files and file size as rlimits that
  bubblewrap and everything under it inherit; the bytes under its writable directories, watched by the
  runner (:meth:`Sandbox.over_disk_limit`); the time limit as before.

The child never holds credentials: its environment is the allow-list of :mod:`workers.isolation.child_env`, and the
worker (trusted) reads and hashes what the child left only after it exited, and publishes it.

Why bubblewrap: a Debian package, no daemon and no setuid (it runs on unprivileged user namespaces), the
tool Flatpak builds on, and one process per compile with a start cost of milliseconds. nsjail and gVisor
need a build or a runtime of their own; a container per compile needs a container engine on the worker.
Where user namespaces cannot be had (a Kubernetes pod without them, Docker's default seccomp profile),
:func:`probe` fails and the worker refuses to start unless ``COMPILESVC_SANDBOX=pod`` hands compiles to a
secret-less compile container of its pod (:mod:`workers.isolation.compile_runner`,
:mod:`workers.isolation.spool_process`) or
``COMPILESVC_SANDBOX=off`` says the operator isolates compiles some other way (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path

from compilesvc.config.settings import Settings
from compilesvc.hostinfo import host_memory_bytes

#: System paths every compile needs (the C compiler, headers and libraries, the loader's cache), read-only.
SYSTEM_READ_PATHS = ("/usr", "/etc/ld.so.cache", "/etc/alternatives", "/sys/devices/system/cpu")
#: Top-level names that are symlinks into /usr on merged-/usr systems (Debian 12): recreated as symlinks.
MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: The Neuron device nodes (the driver creates /dev/neuron0 …); COMPILESVC_NEURON_DEVICE_GLOB overrides it
#: the way the backend reads it (workers.backends.neuron), so the double's fake nodes are bound the same way.
DEVICE_GLOB = "/dev/neuron[0-9]*"
DEVICE_GLOB_ENV = "COMPILESVC_NEURON_DEVICE_GLOB"
#: Where, inside the sandbox, the child's temporary files go (a tmpfs of ``Limits.tmp_bytes``).
SANDBOX_TMP = "/tmp"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up on this host; the message says why and what the operator can do."""


@dataclass(frozen=True)
class Limits:
    """What one compile may use. ``None``: unlimited (only where an operator asked for it)."""

    memory_bytes: int | None
    #: Whether the operator chose ``memory_bytes``: only then does an allocation failure say the compile
    #: needed more than its limit (the default, the host's RAM, fails the same way a busy host does).
    memory_set: bool
    processes: int
    open_files: int
    file_bytes: int
    disk_bytes: int
    tmp_bytes: int

    def rlimits(self) -> list[tuple[int, int]]:
        limits = [(resource.RLIMIT_NPROC, self.processes), (resource.RLIMIT_NOFILE, self.open_files),
                  (resource.RLIMIT_FSIZE, self.file_bytes), (resource.RLIMIT_CORE, 0)]
        if self.memory_bytes is not None:
            limits.append((resource.RLIMIT_AS, self.memory_bytes))
        return limits


@dataclass(frozen=True)
class Policy:
    """The sandbox of a worker: on or (explicitly) off, whom the child runs as, its limits and extra reads."""

    enabled: bool
    user: tuple[int, int] | None  # (uid, gid) the child runs as when the worker is root
    limits: Limits
    extra_read_paths: tuple[Path, ...] = ()
    #: Paths no bind may contain: the embedded default's data directory (its admin token, keys, ledger), the
    #: worker's home (cloud credentials, the CLI's token file) and the artifact signing key.
    secret_paths: tuple[Path, ...] = ()
    bwrap: str = "bwrap"

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        mib = 1024 * 1024
        memory: int | None = host_memory_bytes()  # what this process may use: the host's, or its cgroup's limit
        if settings.sandbox_memory_mb:
            memory = settings.sandbox_memory_mb * mib
        elif settings.sandbox == "pod":
            memory = None  # the compile runs in another container, whose own memory limit binds it, not ours
        limits = Limits(memory_bytes=memory, memory_set=bool(settings.sandbox_memory_mb),
                        processes=settings.sandbox_max_processes, open_files=settings.sandbox_max_open_files,
                        file_bytes=settings.sandbox_max_file_mb * mib, disk_bytes=settings.sandbox_max_disk_mb * mib,
                        tmp_bytes=settings.sandbox_tmp_mb * mib)
        extra = tuple(Path(p) for p in settings.sandbox_read_paths.split(",") if p.strip())
        secret = (settings.data_dir.expanduser().resolve(), Path.home().resolve(),
                  *([settings.signing_key_file.expanduser().resolve()] if settings.signing_key_file else []),
                  *(Path(p) for p in SERVICE_SECRET_DIRS), *(Path(os.path.realpath(p)) for p in SERVICE_SECRET_DIRS))
        return cls(enabled=settings.sandbox != "off", user=resolve_user(settings.sandbox_user),
                   limits=limits, extra_read_paths=extra, secret_paths=secret)


def resolve_user(name: str) -> tuple[int, int]:
    """``name`` (a user name or a numeric uid, optionally ``uid:gid``) as (uid, gid)."""
    uid_text, _, gid_text = name.partition(":")
    if uid_text.isdigit():
        uid = int(uid_text)
        return uid, int(gid_text) if gid_text.isdigit() else uid
    try:
        entry = pwd.getpwnam(uid_text)
    except KeyError:
        raise SandboxUnavailable(f"COMPILESVC_SANDBOX_USER={name!r}: no such user on this host; name an "
                                 f"existing user or a numeric uid[:gid]") from None
    return entry.pw_uid, int(gid_text) if gid_text.isdigit() else entry.pw_gid


def _package_dir(name: str) -> Path:
    module = sys.modules.get(name) or __import__(name)
    return Path(next(iter(module.__path__))).resolve()


#: Where orchestrators put a container's credentials: Docker's and Compose's secrets, Kubernetes'
#: service-account token (a worker that annotates its pod has one). Never bound, whatever the settings add.
SERVICE_SECRET_DIRS = ("/run/secrets", "/var/run/secrets")


def toolchain_paths(env: Mapping[str, str], secret_paths: Iterable[Path] = ()) -> list[Path]:
    """What the child reads to run at all: the interpreter (where its binary really lives and the virtualenv
    pointing at it), our two packages' directories (never a checkout's root, which may hold the embedded
    default's data directory), the ``PATH``, ``PYTHONPATH`` and ``LD_LIBRARY_PATH`` entries of the child's
    environment, and the system paths; minus any path holding one of ``secret_paths``."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix),
             Path(os.path.realpath(sys.executable)).parent.parent, _package_dir("compilesvc"),
             _package_dir("workers")}
    for name in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH"):
        paths.update(Path(p) for p in env.get(name, "").split(os.pathsep) if p.startswith("/"))
    paths.update(Path(p) for p in SYSTEM_READ_PATHS)
    # Real paths (/bin is a link into /usr on merged-/usr hosts, recreated as such inside), each bound once.
    real = {Path(os.path.realpath(p)) for p in paths if p.exists()}
    return sorted(p for p in real if not any(parent in real for parent in p.parents)
                  and not holds_secret(p, secret_paths))


def holds_secret(path: Path, secret_paths: Iterable[Path]) -> bool:
    """Whether binding ``path`` would show one of ``secret_paths`` (it is one, or a directory above one)."""
    return any(path == s or path in s.parents for s in (Path(p) for p in secret_paths))


def device_nodes(env: Mapping[str, str]) -> list[Path]:
    """The Neuron devices a compile may use: exactly the host's ``/dev/neuron*`` (or the double's)."""
    return sorted(Path(p) for p in glob(env.get(DEVICE_GLOB_ENV) or DEVICE_GLOB))


@dataclass
class Mounts:
    """What one compile sees besides the toolchain: read-only files, writable directories, and private
    directories mounted at another path (``{inside: outside}``)."""

    read_only: list[Path] = field(default_factory=list)
    writable: list[Path] = field(default_factory=list)
    private: dict[Path, Path] = field(default_factory=dict)


class Sandbox:
    """The command line and process settings that run one compile child inside the sandbox."""

    def __init__(self, policy: Policy, mounts: Mounts, env: Mapping[str, str]):
        self.policy = policy
        self.mounts = mounts
        self.env = env

    @property
    def drops_user(self) -> bool:
        return self.policy.user is not None and os.geteuid() == 0

    def hand_over(self) -> None:
        """Give the attempt's files to the sandbox user (a root worker runs the child as another uid): the
        writable ones to write, the model and request to read (bound read-only, so owning them changes
        nothing else: the mount refuses writes and mode changes)."""
        if not self.drops_user:
            return
        assert self.policy.user is not None
        uid, gid = self.policy.user
        for top in [*self.mounts.read_only, *self.mounts.writable, *self.mounts.private.values()]:
            os.lchown(top, uid, gid)  # a file (request.json) or a directory, walked below
            for root, dirs, files in os.walk(top):
                for name in [*dirs, *files]:
                    os.lchown(os.path.join(root, name), uid, gid)

    def argv(self, command: list[str], cwd: Path) -> list[str]:
        """bubblewrap's command line for ``command``."""
        limits = self.policy.limits
        args = [shutil.which(self.policy.bwrap) or self.policy.bwrap,
                "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session"]
        if self.drops_user:
            # bubblewrap runs as root: it mounts what root may read, and the child leaves root below (setpriv).
            # Until then it keeps what that takes, and what entering its cwd (the sandbox user's) takes; the
            # kernel clears every capability when the uids leave 0.
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_DAC_READ_SEARCH"]
        else:
            args += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        # Mounts apply in order: the private /tmp first, so binds below it (the work root is under the
        # host's temporary directory) land on top of it.
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
                 "--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", SANDBOX_TMP]
        for name in MERGED_USR:
            top = Path("/") / name
            if top.is_symlink():
                args += ["--symlink", os.readlink(top), str(top)]
            elif top.is_dir():
                args += ["--ro-bind", str(top), str(top)]
        read_only = toolchain_paths(self.env, self.policy.secret_paths) + [
            p for p in self.policy.extra_read_paths
            if p.exists() and not holds_secret(Path(os.path.realpath(p)), self.policy.secret_paths)]
        # bubblewrap makes missing parents of a bind with the host's modes (/root: 0700, which the sandbox
        # user could not cross): make them first, open to traverse, holding nothing but the binds.
        # Device nodes too: COMPILESVC_NEURON_DEVICE_GLOB may place them under a directory the user cannot cross.
        nodes = device_nodes(self.env)
        parents = {parent for path in [*read_only, *self.mounts.read_only, *self.mounts.writable,
                                       *self.mounts.private, *nodes] for parent in path.parents}
        for parent in sorted(parents - {Path("/"), Path(SANDBOX_TMP)}, key=lambda p: len(p.parts)):
            args += ["--perms", "0755", "--dir", str(parent)]
        for path in read_only + self.mounts.read_only:
            args += ["--ro-bind", str(path), str(path)]
        for path in self.mounts.writable:
            args += ["--bind", str(path), str(path)]
        for inside, outside in self.mounts.private.items():
            args += ["--bind", str(outside), str(inside)]
        for node in nodes:
            args += ["--dev-bind", str(node), str(node)]
        args += ["--chdir", str(cwd), "--"]
        if self.drops_user:
            assert self.policy.user is not None
            uid, gid = self.policy.user
            # setpriv (util-linux): real, effective and saved ids, no supplementary groups; the kernel clears
            # the capabilities on the switch and bubblewrap's no_new_privs keeps them from coming back.
            args += [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}",
                     "--clear-groups", "--"]
        return args + command

    def process_cwd(self, cwd: Path) -> Path:
        """Where the process this sandbox starts begins: bubblewrap's own root (``--chdir`` sets the child's)."""
        return Path("/")

    def environment(self, cwd: Path) -> dict[str, str]:
        """The child's environment inside: ``HOME`` and ``TMPDIR`` point at what it may write, and ``PATH``
        finds this interpreter's ``python3`` first (a launcher such as pyenv's shims needs files outside the
        toolchain; scripts like ``neuronx-cc`` start with ``#!/usr/bin/env python3``)."""
        path = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), self.env.get("PATH")]))
        return {**self.env, "HOME": str(cwd), "TMPDIR": SANDBOX_TMP, "PATH": path}

    def preexec(self) -> Callable[[], None]:
        """Applied in the forked process, after Popen switched users: the limits, inherited by bubblewrap and
        everything it starts. Resolved before the fork (only C calls after it)."""
        rlimits = self.policy.limits.rlimits()
        setrlimit = resource.setrlimit

        def apply() -> None:
            for which, value in rlimits:
                setrlimit(which, (value, value))

        return apply

    def disk_bytes(self) -> int:
        """Bytes under the child's writable directories (not following links)."""
        total = 0
        for directory in [*self.mounts.writable, *self.mounts.private.values()]:
            total += _tree_bytes(directory)
        return total

    def over_disk_limit(self) -> str | None:
        """Why the compile must stop, if it wrote more than its disk limit."""
        used = self.disk_bytes()
        if used > self.policy.limits.disk_bytes:
            return (f"wrote {used} bytes, more than the sandbox's disk limit of {self.policy.limits.disk_bytes} "
                    f"(COMPILESVC_SANDBOX_MAX_DISK_MB)")
        return None


def output_limit_why(max_bytes: int) -> str:
    """Why a compile that printed more than ``max_bytes`` is stopped (the runner's and the pod runner's words)."""
    return (f"printed more than {max_bytes} bytes of output, the sandbox's output limit "
            f"(COMPILESVC_SANDBOX_MAX_LOG_MB)")


def _tree_bytes(directory: Path) -> int:
    total = 0
    stack = [str(directory)]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def sandbox_for(policy: Policy, mounts: Mounts, env: Mapping[str, str]) -> Sandbox | None:
    """The :class:`Sandbox` of one child, or None when the operator turned the sandbox off."""
    return Sandbox(policy, mounts, env) if policy.enabled else None


def probe(policy: Policy, env: Mapping[str, str], scratch: Path) -> None:
    """Start the interpreter inside a sandbox as a compile would; raise :class:`SandboxUnavailable` with the
    reason and the way out if that fails (bubblewrap missing, user namespaces refused, the sandbox user
    unable to run the toolchain)."""
    if shutil.which(policy.bwrap) is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: compiles run untrusted model code and must be isolated. "
            "Install it (apt-get install bubblewrap), or set COMPILESVC_SANDBOX=off if this worker is "
            "isolated another way (docs/deploy.md, 'Compile isolation')")
    scratch.mkdir(parents=True, exist_ok=True)
    sandbox = Sandbox(policy, Mounts(writable=[scratch]), env)
    sandbox.hand_over()
    run = subprocess.run(sandbox.argv([sys.executable, "-c", "import workers.backends.compile_child"], scratch),
                         env=sandbox.environment(scratch), preexec_fn=sandbox.preexec(), capture_output=True,
                         text=True, timeout=120, check=False)
    if run.returncode != 0:
        reason = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
        raise SandboxUnavailable(
            f"the compile sandbox does not start on this host ({reason}). bubblewrap needs unprivileged user "
            f"namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; in a "
            f"container, a seccomp and AppArmor profile that allow them), and the sandbox user "
            f"(COMPILESVC_SANDBOX_USER) must be able to run this Python. Or set COMPILESVC_SANDBOX=pod with a "
            f"compile container beside this worker, or COMPILESVC_SANDBOX=off if this worker is isolated "
            f"another way (docs/deploy.md, 'Compile isolation')")

