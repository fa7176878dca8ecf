"""Peak tensor memory on CPU, where torch has no allocator statistics.

A dispatch mode sees every tensor an operator returns; the tracker keeps the storages alive at
that moment (weakly) plus the states present before it started (parameters, gradients,
optimizer states), and after each operator sums their current sizes. Summing sizes rather than
counting allocations follows FSDP2, which frees unsharded parameters by resizing storages to
zero. What it measures: bytes of live tensor storages (DTensors by their local shard). What it
does not: allocator caching and fragmentation, the interpreter, torch's own buffers.
torch's MemTracker does the same with per-module statistics, but refuses modules called more
than once per step, which every micro-batched step does.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from runtime.parallel import local_tensor

_dereference = weakref.ref.__call__   # the plain dereference WeakIdRef.__call__ wraps


def _storage(t: torch.Tensor):
    local = local_tensor(t)
    if local.device.type == "meta":
        return None
    return local.untyped_storage()


class TensorBytesTracker(TorchDispatchMode):
    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._live = WeakIdKeyDictionary()
        self.peak_bytes = 0
        for t in existing:
            self._add(t)
        self._update()

    def _add(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is not None:
            self._live[st] = True

    def _update(self) -> None:
        """Sum the live storages' current sizes. Runs after every operator over every tracked
        storage, so it reads the dictionary's weak references itself: what its keys() does per
        storage (dereference, then _fix_weakref, the resurrection fix torch's WeakIdRef applies),
        without the generators and the method call around each (most of a tracked CPU step is
        this sum)."""
        current = 0
        for ref in list(self._live.data):   # a copy: a storage that dies meanwhile leaves the dict
            st = _dereference(ref)
            if st is not None:
                st._fix_weakref()
                current += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add, out)
        self._update()
        return out


def state_tensors(modules: Iterable[torch.nn.Module], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, gradients and optimizer states that exist before the tracked step."""
    out: list[torch.Tensor] = []
    for mod in modules:
        for p in mod.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out
