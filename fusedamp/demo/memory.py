"""The demo's memory table: each mode's bytes counted from its tensors, the same on CPU and GPU.

A mode's memory is its weights (parameters and buffers), its gradients, its optimizer state
and the activations autograd saves for backward (counted with
``torch.autograd.graph.saved_tensors_hooks`` during one forward pass). The optimizer state is
split by what each state tensor is, read from its key, so that any optimizer's state lands in
the table: ``masters`` (fp32 masters, bf16 remainders: keys naming a master), ``moments``
(Adam's ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``, SGD's ``momentum_buffer``, and any
quantized moment's codes and block scales, whose keys start with those names) and ``other``
(step counters, seeds). Tensors sharing a storage count once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["MemoryBreakdown", "state_kind", "optimizer_state_bytes", "tensor_bytes", "saved_activation_bytes"]

_MOMENT_PREFIXES = ("exp_avg", "max_exp_avg", "momentum", "moment")
_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float64: "fp64",
}


@dataclass
class MemoryBreakdown:
    """Bytes of one mode's tensors by role; ``state`` holds the optimizer state's bytes by
    ``"key dtype"`` (``"exp_avg fp32"``), ``cuda_peak`` the CUDA allocator's peak for the mode
    (None on CPU).

    >>> MemoryBreakdown(weights=4, grads=4, masters=0, moments=8, other=0, activations=16).total
    32
    """

    weights: int = 0
    grads: int = 0
    masters: int = 0
    moments: int = 0
    other: int = 0
    activations: int = 0
    state: dict[str, int] = field(default_factory=dict)
    cuda_peak: int | None = None

    @property
    def optimizer(self) -> int:
        """All of the optimizer state."""
        return self.masters + self.moments + self.other

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def state_kind(key: object) -> str:
    """Which column an optimizer state entry called ``key`` belongs to: ``"masters"``,
    ``"moments"`` or ``"other"``.

    >>> state_kind("master_remainder"), state_kind("exp_avg_sq"), state_kind("step")
    ('masters', 'moments', 'other')
    """
    name = str(key).lower()
    if "master" in name:
        return "masters"
    if name.startswith(_MOMENT_PREFIXES):
        return "moments"
    return "other"


def _storage_key(tensor: Tensor) -> tuple[int, int]:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # opaque tensors (oneDNN's) have no storage
        return id(tensor), tensor.numel() * tensor.element_size()
    return storage.data_ptr(), storage.nbytes()


def tensor_bytes(tensors: Iterable[Tensor], exclude: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views and tied tensors
    share one), leaving out those in ``exclude`` (``(data_ptr, nbytes)`` pairs).

    >>> base = torch.zeros(10)
    >>> tensor_bytes([base, base[:5], torch.zeros(3, dtype=torch.bfloat16)])
    46
    """
    storages = {_storage_key(t) for t in tensors} - (exclude or set())
    return sum(nbytes for _, nbytes in storages)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[dict[str, int], dict[str, int]]:
    """The bytes of ``optimizer``'s state tensors by kind (:func:`state_kind`) and by
    ``"key dtype"``; each storage counts once.

    >>> model = nn.Linear(3, 2)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> model(torch.ones(1, 3)).sum().backward(); optimizer.step()
    >>> optimizer_state_bytes(optimizer)[0]
    {'masters': 0, 'moments': 64, 'other': 8}
    """
    kinds = {"masters": 0, "moments": 0, "other": 0}
    by_key: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, Tensor) or _storage_key(value) in seen:
                continue
            nbytes = _storage_key(value)[1]
            seen.add(_storage_key(value))
            kinds[state_kind(key)] += nbytes
            label = f"{key} {_DTYPE_NAMES.get(value.dtype, str(value.dtype).removeprefix('torch.'))}"
            by_key[label] = by_key.get(label, 0) + nbytes
    return kinds, by_key


def saved_activation_bytes(model: nn.Module, forward: Callable[[], Tensor]) -> tuple[Tensor, int]:
    """Runs ``forward()`` (which builds a graph) and returns its result and the bytes autograd
    saved for backward along the way, each storage once, leaving out ``model``'s parameters
    and buffers (already counted as weights) but not the half copies autocast makes of them.

    >>> model = nn.Linear(4, 3, bias=False)
    >>> out, saved = saved_activation_bytes(model, lambda: model(torch.ones(2, 4)))
    >>> saved  # the input, 2 x 4 fp32 values; the weight is the model's own
    32
    """
    own = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    saved: dict[tuple[int, int], int] = {}

    def pack(tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in own:
            saved[key] = key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    return out, sum(saved.values())
