"""`python -m gpu_check.build`: setup.py's build_ext in place, its C++ files compiled side by side. setup.py builds
one extension of nine files, and build_ext's -j runs extensions (not files) in parallel; pybind11's ParallelCompile
(MAX_JOBS jobs, all cores where unset) compiles the files of one extension at once. Once setup.py installs it
itself, this is the plain build."""

from __future__ import annotations

import os
import runpy
import sys

from gpu_check.steps import ROOT


def main() -> int:
    try:
        from pybind11.setup_helpers import ParallelCompile
    except ImportError:  # setup.py then builds no extension, and the kernel check that follows fails
        print("gpu_check.build: pybind11 is not installed; the C++ kernels cannot build", flush=True)
    else:
        ParallelCompile("MAX_JOBS").install()
    os.chdir(ROOT)
    sys.argv = ["setup.py", "-q", "build_ext", "--inplace"]
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
