"""The simulated GPU's memory as a device of its own, strict where CUDA is strict.

Tensors on it (`simgpu:0`, torch's PrivateUse1 slot registered as a Python backend) are DeviceTensors: wrappers
around host memory that every torch op reaches through `__torch_dispatch__`. There the device refuses what CUDA
refuses and counts what CUDA makes slow:

- an op mixing a device tensor with a host tensor of one element or more raises, as CUDA does (0-d host tensors
  are scalars, as on CUDA);
- every host sync is counted and named by the unit that made it: a device-to-host copy (`.cpu()`, `.to("cpu")`),
  `.item()` / `int()` / `bool()`, `.tolist()`, an op whose output size depends on the data (`nonzero`, boolean
  indexing, `unique`), a blocking host-to-device copy (a tensor made from Python data on the device);
- a "non-blocking" host-to-device copy from memory that is not page-locked is counted: CUDA runs it
  synchronously;
- staging slots (device buffers that the backend fills by `copy_h2d`) are checked for ordering: a compute that
  reads a slot whose latest copy it did not wait for, or a copy that refills a slot the compute stream has read
  since the copy stream last waited for the compute stream, is an error (`SlotOrderError`).

The backend (sim.py) owns one DeviceState: its counters, its page-locked host buffers and its slots.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

from offload.errors import OffloadError

DEVICE_TYPE = "simgpu"
_setup_lock = threading.Lock()
_registered = False


class SlotOrderError(OffloadError):
    """A staging slot used out of the order the device's events guarantee."""


def sim_device() -> torch.device:
    """The simulated GPU's torch device, registered on first use (once per process)."""
    global _registered
    with _setup_lock:
        if not _registered:
            from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

            _setup_privateuseone_for_python_backend(DEVICE_TYPE)
            _register_factories()
            _registered = True
    return torch.device(DEVICE_TYPE, 0)


def is_device(t) -> bool:
    return isinstance(t, DeviceTensor)


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The host memory behind a device tensor (the simulator's own access, unchecked and uncounted)."""
    return t.inner if isinstance(t, DeviceTensor) else t


# what the device counts -----------------------------------------------------------------------------------
SYNC_OPS = {  # ops that make the host wait for the device on CUDA, by the name the report gives them
    "aten::_local_scalar_dense": "item", "aten::nonzero": "nonzero", "aten::masked_select": "masked_select",
    "aten::_unique2": "unique", "aten::unique_consecutive": "unique", "aten::unique_dim": "unique",
    "aten::is_nonzero": "item", "aten::equal": "item", "aten::nonzero_static": None,
}
NO_KERNEL_OPS = {  # views and metadata: no kernel is launched on CUDA
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::transpose", "aten::t", "aten::permute",
    "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided",
    "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::alias", "aten::detach",
    "aten::unflatten", "aten::flatten", "aten::narrow", "aten::lift_fresh", "aten::empty", "aten::empty_strided",
    "aten::view_as", "aten::movedim", "aten::diagonal", "aten::unfold", "aten::split_with_sizes_copy",
}


@dataclass
class Slot:
    """A staging buffer's ordering state: its latest copy, whether the compute stream waited for that copy (and
    at which of its ops), and whether the copy stream has since waited for the compute stream past its reads."""

    name: str
    copy: object = None  # the handle of the copy that last started filling it
    waited: bool = True
    waited_seq: int = -1  # compute-stream op number when it waited for the copy
    issued: int = 0  # copies the host has issued into it, in the host's order
    waited_gen: int = 0  # the latest of those copies the compute stream (or the host) waited for
    read_seq: int = -1  # compute-stream op number of the latest read
    released: bool = True  # the copy stream waited for a compute marker after the slot's last use


@dataclass
class DeviceState:
    """One simulated device's strictness: counters, page-locked host storage, slots and the unit now running."""

    syncs: Counter = field(default_factory=Counter)  # (unit, what) -> count
    pageable_async_copies: Counter = field(default_factory=Counter)  # unit -> count
    launches: Counter = field(default_factory=Counter)  # unit -> kernel-launching ops
    largest: Counter = field(default_factory=Counter)  # (phase, op) -> most elements one call made on the device
    pinned: set = field(default_factory=set)  # storage data pointers of page-locked host buffers
    slots: dict = field(default_factory=dict)  # storage data pointer -> Slot
    compute_seq: int = 0
    on_sync: object = None  # callable(unit, phase, what): the backend's record of each sync
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # the unit the calling thread works for (a launch on the compute stream, a hand-over on the host)
    @property
    def unit(self) -> str:
        return getattr(self._local, "unit", "") or "(host)"

    def set_unit(self, unit: str, phase: str | None = None) -> None:
        self._local.unit = unit
        if phase is not None:
            self._local.phase = phase

    @property
    def phase(self) -> str:
        return getattr(self._local, "phase", "decode")

    @property
    def on_compute_stream(self) -> bool:
        return getattr(self._local, "compute", False)

    def mark_compute_thread(self) -> None:
        self._local.compute = True

    def count_sync(self, what: str) -> None:
        with self._lock:
            self.syncs[(self.unit, what)] += 1
        if self.on_sync is not None:
            self.on_sync(self.unit, self.phase, what)

    def count_pageable(self) -> None:
        with self._lock:
            self.pageable_async_copies[self.unit] += 1
        self.count_sync("pageable copy")

    def count_launch(self) -> None:
        with self._lock:
            self.launches[self.unit] += 1

    def pin(self, t: torch.Tensor) -> None:
        self.pinned.add(t.untyped_storage().data_ptr())

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.pinned

    # slot ordering --------------------------------------------------------------------------------------
    def add_slot(self, buf: torch.Tensor, name: str) -> None:
        self.slots[host_view(buf).untyped_storage().data_ptr()] = Slot(name)

    def slot_of(self, t: torch.Tensor) -> Slot | None:
        return self.slots.get(host_view(t).untyped_storage().data_ptr()) if self.slots else None

    def copy_issued(self, dst: torch.Tensor, handle) -> None:
        """On the host: a copy into dst's slot is enqueued; ops the host enqueues after it expect its bytes."""
        slot = self.slot_of(dst)
        if slot is not None:
            slot.issued += 1
            handle.slot, handle.gen = slot, slot.issued

    def expected(self) -> dict:
        """What an op enqueued now expects: each slot's latest copy issued so far (taken on the host)."""
        return {key: slot.issued for key, slot in self.slots.items()}

    def expect(self, expected: dict | None) -> None:
        """On the compute stream: the op now running was enqueued when the slots' copies stood at expected."""
        self._local.expected = expected

    def copy_starts(self, dst: torch.Tensor, handle) -> None:
        """On the copy stream: a copy begins to fill dst's slot, which the copy stream must have seen released."""
        slot = self.slot_of(dst)
        if slot is None:
            return
        if not slot.released:
            raise SlotOrderError(f"staging slot {slot.name} was refilled while a compute that read it may still run "
                                 f"(the copy stream did not wait for the compute stream's release of the slot: "
                                 f"wait_done_before_copy)")
        slot.name, slot.copy, slot.waited, slot.released = getattr(handle, "unit", slot.name), handle, False, False

    def copy_waited(self, handle) -> None:
        """The compute stream (or the host) waited for this copy: the slot it filled may be read."""
        for slot in self.slots.values():
            if slot.copy is handle:
                slot.waited, slot.waited_seq = True, self.compute_seq
        slot = getattr(handle, "slot", None)
        if slot is not None:
            slot.waited_gen = max(slot.waited_gen, handle.gen)

    def copy_stream_waited(self, handle, seq: int) -> None:
        """The copy stream waited for handle: a compute marker at compute-stream op seq releases the slots whose
        use ended before it; a slot's own copy (a discarded prefetch) releases that slot."""
        for slot in self.slots.values():
            if slot.copy is handle or (seq >= 0 and slot.waited and max(slot.waited_seq, slot.read_seq) <= seq):
                slot.released = True

    def all_waited(self) -> None:
        """A device-wide synchronize: every copy has landed and every compute has finished."""
        for slot in self.slots.values():
            slot.waited = slot.released = True
            slot.waited_gen = slot.issued

    def reads(self, tensors: list) -> None:
        """On the compute stream: an op reads these device tensors. Each slot's copy issued before the op was
        enqueued must have been waited for on the compute stream, whether or not the copy has started yet (so a
        compute that runs ahead of a late copy is refused as surely as one that reads a copy in flight)."""
        self.compute_seq += 1
        expected = getattr(self._local, "expected", None) or {}
        for t in tensors:
            key = host_view(t).untyped_storage().data_ptr()
            slot = self.slots.get(key)
            if slot is None:
                continue
            if not slot.waited or slot.waited_gen < expected.get(key, 0):
                raise SlotOrderError(f"staging slot {slot.name} was read by {self.unit} before its copy's event was "
                                     f"waited on (wait_copy); the compute would read stale weights")
            slot.read_seq = self.compute_seq


_state: DeviceState | None = None  # the device state DeviceTensors count into (the latest SimBackend's)


def activate(state: DeviceState) -> None:
    global _state
    _state = state


def state() -> DeviceState:
    global _state
    if _state is None:
        _state = DeviceState()
    return _state


# the tensor type -------------------------------------------------------------------------------------------
class DeviceTensor(torch.Tensor):
    """A tensor on the simulated GPU: host memory (inner) behind a tensor whose device is simgpu:0."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        with torch.inference_mode(False):  # a view of a tensor made outside inference mode shares its version counter
            out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                      storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                      device=sim_device(), requires_grad=False)
        out.inner = inner
        return out

    def __repr__(self) -> str:
        return f"DeviceTensor(simgpu, {self.inner!r})"

    def tolist(self):
        state().count_sync("tolist")
        return self.inner.tolist()

    def untyped_storage(self):
        return self.inner.untyped_storage()

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name == "aten::copy_":
            return _copy(args[0], args[1], bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False))
        if name in ("aten::_to_copy", "aten::to"):
            return _to_copy(func, args, kwargs)
        st = state()
        flat, _ = tree_flatten((args, kwargs))
        devices = [t for t in flat if isinstance(t, DeviceTensor)]
        hosts = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.dim() > 0]
        if hosts:
            if name in ("aten::index", "aten::index_put_", "aten::index_put") and _only_indices_on_host(args, hosts):
                st.count_sync("host index")  # CUDA copies host indices to the device and waits
            else:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{DEVICE_TYPE}:0 and cpu! (in {name}, the simulated GPU refuses what CUDA "
                                   f"refuses)")
        if name in SYNC_OPS and SYNC_OPS[name]:
            st.count_sync(SYNC_OPS[name])
        elif name == "aten::index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            st.count_sync("nonzero")  # a boolean index's output size is known only on the device
        if name not in NO_KERNEL_OPS:
            st.count_launch()
        if st.on_compute_stream and st.slots:
            st.reads(devices)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name == "aten::_local_scalar_dense":
            return out
        if name not in NO_KERNEL_OPS:
            made = max((t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), default=0)
            if made > st.largest[(st.phase, name)]:
                st.largest[(st.phase, name)] = made
        return tree_map(_wrap, out)


def _unwrap(t):
    return t.inner if isinstance(t, DeviceTensor) else t


def _wrap(t):
    return DeviceTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) else t


def _only_indices_on_host(args, hosts) -> bool:
    """Whether the host tensors of an indexing op are only its indices (CUDA takes those, copying them)."""
    indices = args[1] if len(args) > 1 else []
    return all(any(h is i for i in indices if i is not None) for h in hosts)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """copy_ between any two of host and device, counted as CUDA would make it wait."""
    st = state()
    if isinstance(dst, DeviceTensor) and not isinstance(src, DeviceTensor):  # host to device
        if not non_blocking:
            st.count_sync("blocking copy to device")
        elif not st.is_pinned(src):
            st.count_pageable()
    elif isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor):  # device to host
        if not (non_blocking and st.is_pinned(dst)):
            st.count_sync("copy to host")
    else:
        st.count_launch()
        if st.on_compute_stream and st.slots:
            st.reads([src])
    host_view(dst).copy_(host_view(src))
    return dst


def _to_copy(func, args, kwargs):
    """.to() of a device tensor: to the host it is a sync (CUDA's .to("cpu") waits for the device)."""
    src = args[0]
    device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, torch.device)), None))
    to_host = device is not None and torch.device(device).type == "cpu"
    rest = tuple(torch.device("cpu") if isinstance(a, torch.device) else a for a in args[1:])
    st = state()
    if not to_host and st.on_compute_stream and st.slots:  # a cast on the device reads its source
        st.reads([src])
    out = func(_unwrap(src), *rest, **{k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()})
    if to_host:
        st.count_sync("copy to host")
        return out.clone() if out is src.inner else out
    if out is src.inner:
        return src
    st.count_launch()
    return DeviceTensor(out)


# factories on the device: the PrivateUse1 kernels torch calls for device="simgpu" ---------------------------
def _register_factories() -> None:
    lib = torch.library.Library("aten", "IMPL")  # noqa: F841 - kept alive below
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    # arange: else empty(0) resized in place by arange.out, a wrapper of shape [0] over the values
    lib.impl("arange", lambda end, **kw: _arange(0, end, 1, **kw), "PrivateUse1")
    lib.impl("arange.start", lambda start, end, **kw: _arange(start, end, 1, **kw), "PrivateUse1")
    lib.impl("arange.start_step", _arange, "PrivateUse1")
    _LIBS.append(lib)


_LIBS: list = []


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return DeviceTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return DeviceTensor(torch.empty_strided(size, stride, dtype=dtype))


def _arange(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    return DeviceTensor(torch.arange(start, end, step, dtype=dtype))


def _copy_from(src, dst, non_blocking=False):
    """torch.tensor(data, device=...) and similar: host data copied to the device, blocking."""
    return _copy(dst, src, non_blocking)
