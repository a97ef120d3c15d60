"""The peak of live tensor bytes while torch runs some code on CPU: what
``torch.cuda.max_memory_allocated`` reports on a GPU, counted without one.

:class:`LiveBytes` is a ``TorchDispatchMode``: after every ATen op (forward, backward and
the optimizer's, all on the calling thread for CPU tensors) it records the storages the
op returned and sums the bytes of those still alive (weak references; a storage shared by
views counts once). ``bound`` only grows between sweeps, so the live set is swept only
when it could pass the peak. Tensors made before the mode starts count if passed to ``track``
(the model's weights). A fused kernel's internal scratch (oneDNN, SDPA's flash kernel) is
not an ATen output and is not seen.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.bound = 0  # the live bytes plus those of dead storages not yet swept

    def track(self, tensors) -> None:
        for tensor in tensors:
            self._add(tensor)
        self.peak = max(self.peak, self.current())

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or (key in self.live and not self.live[key][0].expired()):
            return
        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.bound += storage.nbytes()

    def current(self) -> int:
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            del self.live[key]
        self.bound = sum(size for _, size in self.live.values())
        return self.bound

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                self._add(leaf)
        if self.bound > self.peak:  # a new peak is possible: sweep the dead, then count
            self.peak = max(self.peak, self.current())
        return out
