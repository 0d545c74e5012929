"""Host memory of a job's process: its baseline before any weight (Python, torch, the tokenizer), which the CPU
budget counts, and a watch that warns, or stops the job, when the memory it holds passes that budget.

Memory "held" is resident anonymous and shared memory (RssAnon + RssShmem): what the OS cannot drop without
swapping. Pages of the mmap'ed checkpoint (RssFile) are page cache the kernel reclaims under pressure; the
report shows them apart (the peak resident size counts both)."""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import threading
from pathlib import Path

from offload.baseline import round_baseline
from offload.errors import BudgetError, ConfigError
from offload.hardware import format_bytes
from offload.system import held_bytes, memory_limit_bytes

log = logging.getLogger("offload")
WATCH_INTERVAL_S = 0.2  # a sample costs ~20 us (one read of /proc/self/status)


MMAP_THRESHOLD_BYTES = 1 << 20  # glibc serves allocations from this size with mmap, and unmaps them when freed


@functools.lru_cache(maxsize=None)
def keep_heap_small() -> bool:
    """Have glibc's malloc hand every allocation of a MiB or more back to the OS when it is freed.

    glibc raises its mmap threshold (up to 32 MiB) each time a mapped block is freed, so after the first units
    of a model are loaded and released, later ones of a few MiB come from the heap, and the heap keeps their
    pages once they are freed: a load leaves tens of MiB held beyond the budget. A fixed threshold stops that.
    Once per process; False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_mmap_threshold = -3
        return bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident size (VmHWM). Not ru_maxrss: Linux carries that over fork and exec, so a
    process started by a large one reports its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@functools.lru_cache(maxsize=None)
def process_baseline_bytes(model_dir: str) -> int:
    """What this process holds before any weight, with torch imported and the model's tokenizer loaded;
    measured once per process and model (so that `offload plan` and the run it predicts agree)."""
    importlib.import_module("torch")  # the runtime holds it, so the baseline does too
    from offload.weights.model_files import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))
    held = held_bytes()
    del tokenizer
    return round_baseline(held)


STAND_IN_VOCAB = 49152  # the default model's (SmolLM2's) vocabulary: the size of the tokenizer made where it is absent


def calibration_baseline_bytes(log=print) -> int:
    """The baseline `offload calibrate` records, measured offline: torch and the default model's tokenizer where
    that model is already on this machine, else torch and a byte-level tokenizer of its vocabulary size made here
    (ImportError where transformers or tokenizers is missing)."""
    from offload.weights.default_model import local_gguf

    model = local_gguf()
    if model is not None:
        return process_baseline_bytes(str(model))
    importlib.import_module("torch")
    tokenizer = stand_in_tokenizer(STAND_IN_VOCAB)
    held = held_bytes()
    del tokenizer
    log(f"the default model is not on this machine: the process baseline is measured with a {STAND_IN_VOCAB}-token "
        f"tokenizer made here")
    return round_baseline(held)


def stand_in_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of vocab_size tokens (256 bytes, then merges of two of them: at most 65792), made
    in memory: no file, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = []
    for n in range(vocab_size - len(vocab)):
        pair = (alphabet[n // len(alphabet) % len(alphabet)], alphabet[n % len(alphabet)])
        vocab[pair[0] + pair[1]] = len(vocab)
        merges.append(pair)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def check_budget_fits_machine(budget, backend) -> None:
    """A run on this machine allocates: its CPU budget (the whole process) must fit the RAM it may use (MemTotal,
    and a memory cgroup's limit), and its GPU budget the device's memory."""
    ram = memory_limit_bytes()
    if budget.process_cpu_bytes > ram:
        raise ConfigError(f"the CPU budget of {format_bytes(budget.process_cpu_bytes)} (memory.cpu, --cpu-memory) "
                          f"is more than the {format_bytes(ram)} this process may use on this machine (its RAM, or "
                          f"its container's memory limit); set it to at most {format_bytes(ram)}")
    device_bytes = backend.device_memory_bytes() if budget.gpu_bytes else None
    if device_bytes is not None and budget.gpu_bytes > device_bytes:
        raise ConfigError(f"the GPU budget of {format_bytes(budget.gpu_bytes)} (memory.gpu, --gpu-memory) is more "
                          f"than this GPU's {format_bytes(device_bytes)}; set it to at most that")




class MemoryWatch:
    """A thread that samples held memory: keeps its peak, warns once when it passes budget_bytes, and with
    stop=True interrupts the job (run_batch turns that into a BudgetError after flushing)."""

    def __init__(self, budget_bytes: int | None, stop: bool = False, interval_s: float | None = None):
        self.budget_bytes, self.stop_on_exceed = budget_bytes, stop
        self.interval_s = interval_s or WATCH_INTERVAL_S
        self.peak_bytes, self.exceeded_bytes = 0, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offload-memory-watch", daemon=True)

    def __enter__(self) -> "MemoryWatch":
        if self.sample() and self.stop_on_exceed:
            raise BudgetError(f"stopped before generating: {self.message()}")
        if self.budget_bytes:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()

    def sample(self) -> bool:
        """Measure; True the first time the budget is passed (and warn then)."""
        held = held_bytes()
        self.peak_bytes = max(self.peak_bytes, held)
        if not self.budget_bytes or held <= self.budget_bytes or self.exceeded_bytes is not None:
            return False
        self.exceeded_bytes = held
        log.warning(self.message() + ("" if self.stop_on_exceed else
                                      " (memory.on_exceed: stop would stop the job here)"))
        return True

    def message(self) -> str:
        return (f"this process holds {format_bytes(self.exceeded_bytes)}, more than the CPU budget of "
                f"{format_bytes(self.budget_bytes)} (memory.cpu); lower schedule.batch_size or model.max_model_len, "
                f"or raise memory.cpu")

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            if self.sample() and self.stop_on_exceed:
                interrupt_main_thread()  # run_batch turns it into a BudgetError once the outputs are flushed


def interrupt_main_thread() -> None:
    """Raise KeyboardInterrupt in the main thread at its next Python instruction.

    Not _thread.interrupt_main(): that simulates SIGINT and does nothing where SIGINT is ignored, as it is for a job
    started in the background by a script (`offload run job.yaml &`)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                               ctypes.py_object(KeyboardInterrupt))
