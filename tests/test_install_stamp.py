"""scripts/install.sh runs pip only when the install's inputs changed (scripts/install_stamp.py): judged by whether
pip runs, on a scratch copy of the inputs with a stub .venv/bin/python that logs `-m pip` calls instead of running
them (and runs everything else, the stamp script, with this interpreter)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import install_stamp  # noqa: E402

STUB = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "$*" >> "{log}"
    [ -f "{fail}" ] && exit 1
    mkdir -p offload/kernels && touch offload/kernels/_C.so   # what the editable install builds
    exit 0
fi
exec "{python}" "$@"
"""


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The files install.sh reads, copied, and a stub venv whose python logs pip calls to pip.log."""
    root = tmp_path / "checkout"
    for name in ("pyproject.toml", "setup.py", "scripts/install.sh", "scripts/install_stamp.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "csrc", root / "csrc")
    stub = root / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB.format(log=tmp_path / "pip.log", fail=tmp_path / "pip-fails", python=sys.executable))
    stub.chmod(0o755)
    return root


def pip_ran(root: Path, *args: str, env: dict | None = None) -> bool:
    """Run install.sh in root; whether it called pip (and that it succeeded)."""
    log = root.parent / "pip.log"
    log.unlink(missing_ok=True)
    out = subprocess.run(["bash", str(root / "scripts" / "install.sh"), *args], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert out.returncode == 0, out.stderr
    return log.is_file()


def test_pip_runs_only_when_the_inputs_changed(checkout):
    assert pip_ran(checkout)  # no stamp yet
    assert not pip_ran(checkout)  # current: skipped
    assert pip_ran(checkout, env={"OFFLOAD_REINSTALL": "1"})  # forced
    kernel = checkout / "csrc" / "qgemm_avx2.cpp"
    kernel.write_text(kernel.read_text() + "\n// an edit\n")
    assert pip_ran(checkout)  # a kernel edit rebuilds
    assert not pip_ran(checkout)
    (checkout / "csrc" / "new_kernel.inc").write_text("// a new file\n")
    assert pip_ran(checkout)
    (checkout / "setup.py").write_text((checkout / "setup.py").read_text() + "\n")
    assert pip_ran(checkout)
    assert pip_ran(checkout, env={"OFFLOAD_NO_EXT": "1"})  # the extension is not built: another install


def test_each_extra_is_installed_once_and_kept(checkout):
    assert pip_ran(checkout)  # plot, the default
    assert pip_ran(checkout, "test")  # another extra installs
    assert not pip_ran(checkout, "test")
    assert not pip_ran(checkout, "plot")  # installing test kept plot's install
    (checkout / "pyproject.toml").write_text((checkout / "pyproject.toml").read_text() + "\n")
    assert pip_ran(checkout, "test")
    assert pip_ran(checkout, "plot")  # installed from the old inputs: not kept


def test_a_failed_or_undone_install_is_not_current(checkout):
    assert pip_ran(checkout)
    (checkout.parent / "pip-fails").touch()
    out = subprocess.run(["bash", str(checkout / "scripts" / "install.sh"), "plot"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OFFLOAD_REINSTALL": "1"})
    assert out.returncode != 0  # pip failed, and install.sh with it
    (checkout.parent / "pip-fails").unlink()
    assert pip_ran(checkout)  # the failed install left no stamp
    assert not pip_ran(checkout)
    (checkout / "offload" / "kernels" / "_C.so").unlink()  # the built extension is gone
    assert pip_ran(checkout)


def test_the_python_version_is_an_input(tmp_path):
    digest = install_stamp.inputs_digest(ROOT)
    assert digest == install_stamp.inputs_digest(ROOT)
    assert digest != install_stamp.inputs_digest(ROOT, python_version="3.99.0 (another build)")
