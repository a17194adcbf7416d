"""compilesvc.hostinfo: the memory a worker sizes compiles by is its cgroup's limit where there is one (issue
30: inside a container /proc/meminfo reports the node's memory). The cgroup trees below are laid out as the
kernel lays them out (Documentation/admin-guide/cgroup-v2.rst, "memory.max"; cgroup-v1/memory.rst,
"memory.limit_in_bytes"), since this machine has no limit of its own to read."""

from __future__ import annotations

from pathlib import Path

from compilesvc.hostinfo import cgroup_memory_limit, host_memory_bytes

GIB = 1024**3
V1_NO_LIMIT = "9223372036854771712"


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def test_v2_a_pods_limit_on_an_ancestor_binds_its_container(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {
        "cgroup.controllers": "cpu memory pids",
        "kubepods.slice/memory.max": "max",
        "kubepods.slice/pod1/memory.max": str(32 * GIB),
        "kubepods.slice/pod1/worker/memory.max": "max",
    })
    proc = tree(tmp_path, {"self-cgroup": "0::/kubepods.slice/pod1/worker"}) / "self-cgroup"
    assert cgroup_memory_limit(proc, root) == 32 * GIB


def test_v2_inside_a_cgroup_namespace_reads_the_containers_own_root(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"cgroup.controllers": "memory", "memory.max": str(8 * GIB)})
    proc = tree(tmp_path, {"self-cgroup": "0::/"}) / "self-cgroup"
    assert cgroup_memory_limit(proc, root) == 8 * GIB


def test_v1_and_no_limit_at_all(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": V1_NO_LIMIT,
        "memory/docker/abc/memory.limit_in_bytes": str(6 * GIB),
    })
    proc = tree(tmp_path, {"v1": "4:memory:/docker/abc\n1:cpu:/docker/abc\n0::/",
                           "none": "4:memory:/\n0::/"})
    assert cgroup_memory_limit(proc / "v1", root) == 6 * GIB
    assert cgroup_memory_limit(proc / "none", root) is None  # "no limit" is not a limit
    assert cgroup_memory_limit(tmp_path / "missing", root) is None


def test_a_hybrid_host_reads_v2_from_its_unified_mount(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"unified/cgroup.controllers": "", "unified/job/memory.max": str(3 * GIB)})
    proc = tree(tmp_path, {"self-cgroup": "0::/job"}) / "self-cgroup"
    assert cgroup_memory_limit(proc, root) == 3 * GIB


def test_this_hosts_memory_is_at_most_its_meminfo_total() -> None:
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    memory = host_memory_bytes()
    assert memory is not None and 0 < memory <= total
    limit = cgroup_memory_limit()
    assert memory == (total if limit is None else min(total, limit))
