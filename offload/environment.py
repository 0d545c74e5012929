"""The environment variables offload reads, each with its meaning: one table, shown by `offload --help` and in
docs/environment.md (`python -m offload.environment > docs/environment.md` writes it; a test checks it is current).
Each module reads its own variable; a test checks that every variable read is in this table."""

from __future__ import annotations

ENVIRONMENT = {
    "OFFLOAD_CACHE": "offload's cache folder: packed weights, the default model once downloaded, the calibrated "
                     "profile (default $XDG_CACHE_HOME/offload, else ~/.cache/offload)",
    "OFFLOAD_PACKED_CACHE": "0: pack quantized weights again at every load instead of keeping them packed in the "
                            "cache (default 1)",
    "OFFLOAD_KERNELS": "the CPU kernels: auto (default: the fastest this CPU runs), avx512, avx2, scalar or numba "
                       "(numba also lets offload calibrate measure them, which it otherwise refuses on x86-64)",
    "OFFLOAD_ADAPTIVE_THREADS": "0: keep the CPU blocks' thread count fixed (default 1: each step chooses all the "
                                "threads or half, by the seconds per token measured)",
    "OFFLOAD_PAGEABLE": "1: copy to the GPU from pageable host memory, pinning nothing (where cudaHostRegister is "
                        "refused)",
    "OFFLOAD_ALLOW_DOWNLOAD": "1: download a Hub id that is not in the local Hugging Face cache (default: never "
                              "download; HF_HUB_OFFLINE=1 forbids it still)",
    "OFFLOAD_API_KEY": "offload serve's API key where --api-key (serve.api_key) is not given",
    "OFFLOAD_NO_EXT": "1 at install: build no C++ kernels (the numba kernels run)",
    "CXX": "at install: the C++ compiler that builds the kernels (setuptools'); gcc's inlining flag is added "
           "unless it is clang",
    "CC": "at install: the C compiler (setuptools'); where CXX is unset, it tells clang from gcc",
    "HF_HUB_CACHE": "Hugging Face's hub cache, where Hub ids (org/name) are looked up (default $HF_HOME/hub)",
    "HF_HOME": "Hugging Face's folder; its hub/ is the hub cache where HF_HUB_CACHE is unset (default "
               "$XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface)",
    "HF_HUB_OFFLINE": "1 (or true, yes, on): never download, even with OFFLOAD_ALLOW_DOWNLOAD=1",
    "XDG_CACHE_HOME": "the user's cache folder, under which offload's and Hugging Face's caches are by default "
                      "(default ~/.cache)",
    "TRITON_INTERPRET": "Triton's: 1 runs the Triton attention kernel in Triton's interpreter, on CPU tensors (for "
                        "tests)",
}


def environment_help(columns: int = 79) -> str:
    """The table as `offload --help` ends it: each variable, its meaning beside it wrapped to columns."""
    import textwrap

    indent = " " * (max(map(len, ENVIRONMENT)) + 4)
    lines = [textwrap.fill(meaning, columns, initial_indent=f"  {name}".ljust(len(indent)), subsequent_indent=indent)
             for name, meaning in ENVIRONMENT.items()]
    return "\n".join(["environment variables:", *lines])


def environment_markdown() -> str:
    """docs/environment.md."""
    rows = "\n".join(f"| `{name}` | {meaning} |" for name, meaning in ENVIRONMENT.items())
    return ("# Environment variables\n\nWhat offload reads from the environment (made from "
            "`offload/environment.py`; `offload --help` lists them too).\n\n| variable | meaning |\n|---|---|\n"
            f"{rows}\n")


if __name__ == "__main__":
    print(environment_markdown(), end="")
