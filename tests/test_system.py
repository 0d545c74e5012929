"""offload.system's page-cache room over fake /proc and /sys/fs/cgroup trees: bytes worked out by hand, asserted
exactly."""

from __future__ import annotations

from pathlib import Path

from offload.system import memory_cgroup, page_cache_room_bytes

GiB, MiB = 2**30, 2**20
HOST_RAM = 24 * GiB


def fake_root(tmp_path: Path, cgroup_lines: str, available: int = 20 * GiB) -> Path:
    """A tree with /proc/meminfo (a 24 GiB host, `available` bytes available) and /proc/self/cgroup."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:       {HOST_RAM // 1024} kB\n"
                                           f"MemFree:        {available // 1024} kB\n"
                                           f"MemAvailable:   {available // 1024} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup_lines)
    return tmp_path


def v1_group(folder: Path, limit: int, usage: int, active_file: int, inactive_file: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"cache {active_file + inactive_file}\nhierarchical_memory_limit {limit}\n"
                                        f"total_active_file {active_file}\ntotal_inactive_file {inactive_file}\n")


def v2_group(folder: Path, usage: int, file_bytes: int, limit: str = "max", high: str = "max") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in (("memory.max", limit), ("memory.high", high), ("memory.current", usage)):
        (folder / name).write_text(f"{value}\n")
    (folder / "memory.stat").write_text(f"anon {usage - file_bytes}\nfile {file_bytes}\n"
                                        f"active_file {file_bytes // 2}\ninactive_file {file_bytes - file_bytes // 2}\n")


UNLIMITED_V1 = 9223372036854771712


def test_a_host_without_a_limit_keeps_a_sixteenth_of_ram_aside(tmp_path):
    root = fake_root(tmp_path, "4:memory:/\n0::/\n")
    v1_group(root / "sys/fs/cgroup/memory", UNLIMITED_V1, 3 * GiB, GiB, GiB)
    # 20 GiB available - 1 GiB to allocate - 24 GiB / 16 = 17.5 GiB
    assert page_cache_room_bytes(GiB, root=root) == 20 * GiB - GiB - 1536 * MiB


def test_the_reserve_is_a_share_of_the_cgroup_limit_not_of_the_host(tmp_path):
    """The issue's case: a 2.6 GB cgroup on a 24 GiB host. Charged 700 MiB, of which 300 MiB are file pages
    (reclaimable): 400 MiB held. Room: 2480 MiB - 400 MiB held - 800 MiB to allocate - 2480 MiB / 16 (155 MiB)
    = 1125 MiB; with the host's 1.5 GiB as reserve it was 0."""
    root = fake_root(tmp_path, "4:memory:/batch/job1\n0::/\n")
    v1_group(root / "sys/fs/cgroup/memory", UNLIMITED_V1, 5 * GiB, GiB, GiB)
    v1_group(root / "sys/fs/cgroup/memory/batch", UNLIMITED_V1, 800 * MiB, 200 * MiB, 200 * MiB)
    v1_group(root / "sys/fs/cgroup/memory/batch/job1", 2480 * MiB, 700 * MiB, 100 * MiB, 200 * MiB)
    assert memory_cgroup(root) == (root / "sys/fs/cgroup/memory/batch/job1", False)
    assert page_cache_room_bytes(800 * MiB, root=root) == 2480 * MiB - 400 * MiB - 800 * MiB - 155 * MiB


def test_the_tightest_of_nested_v2_limits_and_memory_high_applies(tmp_path):
    """A job's cgroup (memory.max 8 GiB, memory.high 6 GiB) under a slice limited to 4 GiB that holds 1 GiB
    beside its file pages: room 4 GiB - 1 GiB - 512 MiB to allocate - 4 GiB / 16 = 2304 MiB."""
    root = fake_root(tmp_path, "0::/slice/job\n")
    cgroup = root / "sys/fs/cgroup"
    v2_group(cgroup, usage=6 * GiB, file_bytes=2 * GiB)  # the root: no memory.max there
    for name in ("memory.max", "memory.high", "memory.current"):
        (cgroup / name).unlink()
    (cgroup / "cgroup.controllers").write_text("cpu memory\n")
    v2_group(cgroup / "slice", usage=3 * GiB, file_bytes=2 * GiB, limit=str(4 * GiB))
    v2_group(cgroup / "slice/job", usage=2 * GiB, file_bytes=1536 * MiB, limit=str(8 * GiB), high=str(6 * GiB))
    assert page_cache_room_bytes(512 * MiB, root=root) == 4 * GiB - GiB - 512 * MiB - 256 * MiB
    (cgroup / "slice/memory.max").write_text("max\n")  # now the job's memory.high applies, with its 512 MiB held
    assert page_cache_room_bytes(512 * MiB, root=root) == 6 * GiB - 512 * MiB - 512 * MiB - 384 * MiB


def test_a_container_that_mounts_its_own_cgroup_as_the_root(tmp_path):
    """Docker on cgroup v1: /proc/self/cgroup names /docker/<id>, the mount holds that cgroup's files at its
    root. Room: 2 GiB - (1 GiB - 256 MiB file pages) - 0 - 2 GiB / 16 = 1152 MiB."""
    root = fake_root(tmp_path, "4:memory:/docker/0123abcd\n")
    v1_group(root / "sys/fs/cgroup/memory", 2 * GiB, GiB, 128 * MiB, 128 * MiB)
    assert page_cache_room_bytes(0, root=root) == 2 * GiB - 768 * MiB - 128 * MiB


def test_never_negative_and_zero_without_meminfo(tmp_path):
    root = fake_root(tmp_path, "4:memory:/job\n")
    v1_group(root / "sys/fs/cgroup/memory/job", GiB, 900 * MiB, 0, 0)
    assert page_cache_room_bytes(200 * MiB, root=root) == 0
    assert page_cache_room_bytes(0, root=tmp_path / "nothing") == 0


def test_what_the_process_holds_already_counts_as_part_of_its_total(tmp_path):
    """`offload plan` (no torch) and its run (torch imported, 300 MiB more held, so 300 MiB less available) see
    one room: the process's own held memory is part of the total it will hold."""
    plan_root = fake_root(tmp_path / "plan", "0::/\n")
    run_root = fake_root(tmp_path / "run", "0::/\n", available=20 * GiB - 300 * MiB)
    (plan_root / "proc/self/status").write_text("Name: python\nRssAnon:\t102400 kB\nRssFile:\t5000 kB\n")
    (run_root / "proc/self/status").write_text("Name: python\nRssAnon:\t409600 kB\nRssShmem:\t0 kB\n")
    # 20 GiB available + 100 MiB held - 2 GiB total - 24 GiB / 16
    assert page_cache_room_bytes(2 * GiB, root=plan_root) == 20 * GiB + 100 * MiB - 2 * GiB - 1536 * MiB
    assert page_cache_room_bytes(2 * GiB, root=run_root) == page_cache_room_bytes(2 * GiB, root=plan_root)
