"""What the OS says about this machine: physical RAM, usable cores, the memory cgroup and its limit, and the page
cache a run can count on. No torch, no psutil."""

from __future__ import annotations

import os
from pathlib import Path


def system_memory_bytes() -> int:
    """Physical RAM from the OS (no torch, no psutil)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def memory_cgroup() -> tuple[Path, bool] | None:
    """(folder, is v2) of this process's memory cgroup, or None where /proc or the memory controller is missing."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            return Path("/sys/fs/cgroup") / path.lstrip("/"), True
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), False
    return None


def _cgroup_memory_room() -> int | None:
    """Bytes this process's memory cgroup (v2 or v1) lets it add beside the anonymous memory charged to it now;
    None when it has no limit."""
    found = memory_cgroup()
    if found is None:
        return None
    folder, v2 = found
    limit_file, anon_key = ("memory.max", "anon") if v2 else ("memory.limit_in_bytes", "total_rss")
    try:
        limit = (folder / limit_file).read_text().strip()
        stat = dict(ln.split() for ln in (folder / "memory.stat").read_text().splitlines() if ln.count(" ") == 1)
    except (OSError, ValueError):
        return None
    limit = 2**62 if limit == "max" else min(int(limit), int(stat.get("hierarchical_memory_limit", 2**62)))
    return None if limit >= 2**60 else limit - int(stat.get(anon_key, 0))


def page_cache_room_bytes(to_allocate: int) -> int:
    """Bytes of page cache the OS can keep for a run that will still allocate to_allocate bytes: what is
    available now (MemAvailable, and the memory cgroup's limit where one is set) less that, less a reserve of
    1/16 of RAM for everything else."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    room = _cgroup_memory_room()
    if room is not None:
        available = min(available, room)
    return max(0, available - to_allocate - system_memory_bytes() // 16)


def system_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
