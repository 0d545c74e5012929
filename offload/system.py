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


ROOT = Path("/")  # where /proc and /sys/fs/cgroup are read from; tests pass a fake tree
RESERVE_FRACTION = 16  # of the memory that applies (RAM, or a memory cgroup's smaller limit), left for what the
# plan does not count: the kernel's own memory, other processes, allocator slack


def memory_cgroup(root: Path = ROOT) -> tuple[Path, bool] | None:
    """(folder, is v2) of this process's memory cgroup, or None where /proc or the memory controller is missing."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mount = root / "sys/fs/cgroup"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (mount / "cgroup.controllers").is_file():
            return mount / path.lstrip("/"), True
        if "memory" in controllers.split(","):
            return mount / "memory" / path.lstrip("/"), False
    return None


def _read_keyed(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (ln.split() for ln in path.read_text().splitlines() if ln.count(" ") == 1)}


def _cgroup_limits(root: Path) -> list[tuple[int, int]]:
    """(limit, bytes charged that reclaim cannot free) of each memory cgroup that limits this process: its own
    and those above it, up to the mount. A folder /proc/self/cgroup names but the mount lacks is skipped: a
    container (Docker on cgroup v1, or a cgroup namespace) mounts its own cgroup as the root."""
    found = memory_cgroup(root)
    if found is None:
        return []
    folder, v2 = found
    mount = root / "sys/fs/cgroup" / ("" if v2 else "memory")
    out = []
    for level in [folder, *folder.parents]:
        if not level.is_relative_to(mount):
            break
        try:
            if v2:
                limits = [(level / name).read_text().strip() for name in ("memory.max", "memory.high")
                          if (level / name).is_file()]
                usage, stat = int((level / "memory.current").read_text()), _read_keyed(level / "memory.stat")
                file_bytes = stat.get("active_file", 0) + stat.get("inactive_file", 0)
            else:
                usage, stat = int((level / "memory.usage_in_bytes").read_text()), _read_keyed(level / "memory.stat")
                limits = [(level / "memory.limit_in_bytes").read_text().strip(),
                          str(stat.get("hierarchical_memory_limit", 2**62))]
                file_bytes = stat.get("total_active_file", 0) + stat.get("total_inactive_file", 0)
        except (OSError, ValueError):
            continue  # no such folder here, or no memory files in it (the v2 root)
        limit = min([int(v) for v in limits if v != "max"] or [2**62])
        if limit < 2**60:
            out.append((limit, max(0, usage - file_bytes)))
    return out


# The reserve is a share of the limit that applies, not of the host's RAM: a 2.5 GiB container on a 24 GiB host
# keeps 160 MiB aside, not 1.5 GiB. A share of the limit rather than of the reclaimable page cache memory.stat
# reports, because that cache moves as files are read (the run's own loads fill it) while the limit stays: the
# plan and its run each measure the room and the planner rounds it (PAGE_CACHE_ROUNDING) so that they agree, which
# holds only for a figure the two processes see alike but for what each of them holds. The reclaimable cache
# counts as room instead: what is charged beyond it (anonymous memory, tmpfs, kernel memory) comes off the limit.
def page_cache_room_bytes(process_bytes: int, root: Path = ROOT) -> int:
    """Bytes of page cache the OS can keep for a run whose process will hold process_bytes in all: what is
    available now (MemAvailable, and under each memory cgroup's limit what reclaim could free) plus what this
    process holds already (it is part of process_bytes), less process_bytes, less 1/RESERVE_FRACTION of the memory
    that applies (RAM, or the smallest cgroup limit). Counting this process's own memory back makes `offload plan`
    (no torch imported) and the run it predicts (torch imported) see the same room."""
    try:
        info = dict(line.split(":", 1) for line in (root / "proc/meminfo").read_text().splitlines())
        available, total = (int(info[key].split()[0]) * 1024 for key in ("MemAvailable", "MemTotal"))
    except (OSError, KeyError, ValueError):
        return 0
    for limit, held in _cgroup_limits(root):
        available, total = min(available, limit - held), min(total, limit)
    return max(0, available + held_bytes(root) - process_bytes - total // RESERVE_FRACTION)


def held_bytes(root: Path = ROOT) -> int:
    """Resident anonymous + shared bytes of this process (what reclaim cannot free of it); 0 where unknown."""
    try:
        lines = (root / "proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(("RssAnon:", "RssShmem:")))


def memory_limit_bytes(root: Path = ROOT) -> int:
    """The RAM this process may use: MemTotal, or a memory cgroup's smaller limit."""
    try:
        info = dict(line.split(":", 1) for line in (root / "proc/meminfo").read_text().splitlines())
        total = int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        total = system_memory_bytes()
    return min([total] + [limit for limit, _ in _cgroup_limits(root)])


def system_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
