"""Fused optimizers: one kernel per device and dtype does unscale, inf-skip, clip and update.

``FusedAdamW`` and ``FusedSGD`` are drop-in for ``torch.optim.AdamW`` / ``SGD`` and add fp32
master weights for float16/bfloat16 params (or exact bf16 "remainder" masters).
"""

from fusedamp.optim._dtensor_state import dtensor_state_dict
from fusedamp.optim._masters import join_bf16_remainder, split_bf16_remainder
from fusedamp.optim.adamw import FusedAdamW
from fusedamp.optim.sgd import FusedSGD

__all__ = ["FusedAdamW", "FusedSGD", "dtensor_state_dict", "join_bf16_remainder", "split_bf16_remainder"]
