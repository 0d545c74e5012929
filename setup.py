"""Build for offload: the optional C++ kernel extension in csrc/ and the shipped configs (see pyproject.toml)."""

import glob
import os
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the kernels if possible; on failure install anyway (numba kernels then serve)."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler failure means: fall back
            print(f"offload: kernel extension not built ({e}); the numba fallback will be used", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"offload: kernel extension {ext.name} not built ({e}); the numba fallback will be used",
                  file=sys.stderr)


def kernel_extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources or os.environ.get("OFFLOAD_NO_EXT") == "1":
        return []
    try:
        from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
    except ImportError:
        print("offload: pybind11 missing, kernel extension not built", file=sys.stderr)
        return []
    # The extension's files compile side by side (MAX_JOBS at once, else every core): build_ext -j runs only
    # extensions in parallel, and this is one extension of nine files.
    ParallelCompile("MAX_JOBS").install()
    # Per-function target attributes select AVX2/AVX-512 code; the baseline stays generic x86-64.
    args = ["-O3", "-std=c++17", "-fopenmp"] if sys.platform != "win32" else ["/O2"]
    # GCC stops inlining once a translation unit has grown by --param inline-unit-growth (40%); the kernel files
    # reach it, and which helpers it leaves as calls then moves with any edit (a q8_0 matrix-vector product ran
    # 1.3x slower for a change elsewhere in its file, RowTile::qat called per block; attention's softmax step was
    # a call). The kernels are written to be inlined whole.
    compiler = os.environ.get("CXX") or os.environ.get("CC") or sysconfig.get_config_var("CXX") or ""
    if sys.platform != "win32" and "clang" not in compiler:
        args.append("--param=inline-unit-growth=1000")
    # Headers and the per-ISA tile template (.inc) are dependencies: editing them must rebuild.
    depends = sorted(glob.glob(os.path.join("csrc", "*.h")) + glob.glob(os.path.join("csrc", "*.inc")))
    return [Pybind11Extension("offload.kernels._C", sources, include_dirs=["csrc"], depends=depends,
                              extra_compile_args=args,
                              extra_link_args=["-fopenmp"] if sys.platform != "win32" else [])]


def config_files():
    """configs/ installed under <prefix>/share/offload/configs, for non-editable installs."""
    out = {}
    for path in glob.glob(os.path.join("configs", "**", "*"), recursive=True):
        if os.path.isfile(path):
            out.setdefault(os.path.join("share", "offload", os.path.dirname(path)), []).append(path)
    return sorted(out.items())


# Metadata, dependencies and the entry point are in pyproject.toml; this file adds what it cannot say:
# the optional C++ extension and the shipped configs.
setup(
    ext_modules=kernel_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    include_package_data=True,
    data_files=config_files(),
)
