"""The stamp scripts/install.sh keeps in .venv: a hash of what the install builds from; pip runs only when it changes.

The inputs: pyproject.toml, setup.py, scripts/install.sh (its torch pin), every file under csrc/ (names and bytes),
OFFLOAD_NO_EXT (whether setup.py builds the extension), the checkout's path and the Python version of the
interpreter running this (the venv's). The stamp file holds that hash, the extras installed with it, and the build
outputs the install left (offload/kernels/*.so): a deleted extension makes the environment stale too.
Standard library only: it runs before anything is installed.

  python scripts/install_stamp.py check .venv/.install-stamp EXTRA    # exit 0: current, skip pip; 1: install
  python scripts/install_stamp.py begin .venv/.install-stamp          # before pip: the stamp no longer holds
  python scripts/install_stamp.py record .venv/.install-stamp EXTRA   # after a successful pip install
  python scripts/install_stamp.py --smoke                             # check, begin, record in a temp folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INPUT_FILES = ("pyproject.toml", "setup.py", "scripts/install.sh")
BUILD_OUTPUTS = "offload/kernels/*.so"


def inputs_digest(root: Path = ROOT, python_version: str = sys.version) -> str:
    """sha256 over the install's inputs under root (see above) and the Python version."""
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    add("python", python_version.encode())
    add("root", str(root.resolve()).encode())
    add("OFFLOAD_NO_EXT", os.environ.get("OFFLOAD_NO_EXT", "").encode())
    for name in INPUT_FILES:
        path = root / name
        add(name, path.read_bytes() if path.is_file() else b"(absent)")
    csrc = root / "csrc"
    for path in sorted(p for p in csrc.rglob("*") if p.is_file()) if csrc.is_dir() else []:
        add(path.relative_to(root).as_posix(), path.read_bytes())
    return h.hexdigest()


def read_stamp(path: Path) -> dict:
    """The stamp's fields, or {} where there is none (or it is unreadable: then the install runs)."""
    try:
        stamp = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def build_outputs(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.glob(BUILD_OUTPUTS))


def is_current(stamp_path: Path, extra: str, root: Path = ROOT) -> bool:
    """Whether the environment was installed from today's inputs with this extra, its build outputs still there."""
    stamp = read_stamp(stamp_path)
    return (stamp.get("inputs") == inputs_digest(root) and extra in stamp.get("extras", [])
            and all((root / p).is_file() for p in stamp.get("outputs", [])))


def begin(stamp_path: Path) -> None:
    """Before pip runs: the stamp moves aside (a failed install then leaves none); an earlier one aside is dropped."""
    aside = stamp_path.with_name(stamp_path.name + ".before")
    if stamp_path.is_file():
        stamp_path.replace(aside)
    else:
        aside.unlink(missing_ok=True)


def record(stamp_path: Path, extra: str, root: Path = ROOT) -> None:
    """After pip succeeded: today's inputs with this extra, plus the extras the stamp set aside by begin() held
    for the same inputs (installing one extra keeps what another installed)."""
    aside = stamp_path.with_name(stamp_path.name + ".before")
    digest, before = inputs_digest(root), read_stamp(aside)
    extras = set(before.get("extras", [])) if before.get("inputs") == digest else set()
    stamp = {"inputs": digest, "extras": sorted(extras | {extra}), "outputs": build_outputs(root)}
    tmp = stamp_path.with_name(stamp_path.name + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    tmp.replace(stamp_path)
    aside.unlink(missing_ok=True)


def smoke() -> int:
    """check / begin / record on a copy of this checkout's inputs in a temp folder: a csrc edit must count."""
    with tempfile.TemporaryDirectory() as tmp:
        root, stamp = Path(tmp), Path(tmp) / "stamp"
        for name in INPUT_FILES + ("csrc/kernels.h",):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes((ROOT / name).read_bytes())
        steps = [not is_current(stamp, "plot", root)]
        begin(stamp)
        record(stamp, "plot", root)
        steps.append(is_current(stamp, "plot", root) and not is_current(stamp, "test", root))
        (root / "csrc" / "kernels.h").write_bytes(b"// edited\n")
        steps.append(not is_current(stamp, "plot", root))
    print(f"install stamp: {sum(steps)} of {len(steps)} checks as expected (absent, recorded, csrc edit)")
    return 0 if all(steps) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", nargs="?", choices=("check", "begin", "record"))
    ap.add_argument("stamp", nargs="?", type=Path, help="the stamp file (install.sh: .venv/.install-stamp)")
    ap.add_argument("extra", nargs="?", help="the extra being installed (plot, test, ...)")
    ap.add_argument("--smoke", action="store_true", help="check, begin and record in a temp folder")
    args = ap.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.action is None or args.stamp is None or (args.action != "begin" and not args.extra):
        ap.error("give an action and the stamp file (and the extra for check and record), or --smoke")
    if args.action == "check":
        return 0 if is_current(args.stamp, args.extra) else 1
    if args.action == "begin":
        begin(args.stamp)
    else:
        record(args.stamp, args.extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
