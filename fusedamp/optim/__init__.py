"""Fused optimizers: one kernel per device and dtype does unscale, inf-skip, clip and update.

``FusedAdamW``, ``FusedSGD`` and ``FusedMuon`` are drop-in for ``torch.optim.AdamW`` / ``SGD`` /
``Muon`` and add fp32 master weights for float16/bfloat16 params (or exact bf16 "remainder"
masters); ``muon_param_groups`` splits a model into FusedMuon's Muon and AdamW groups.
"""

from fusedamp.optim._dtensor_state import dtensor_state_dict
from fusedamp.optim._masters import join_bf16_remainder, split_bf16_remainder
from fusedamp.optim.adamw import FusedAdamW
from fusedamp.optim.muon import FusedMuon, muon_param_groups
from fusedamp.optim.sgd import FusedSGD

__all__ = [
    "FusedAdamW", "FusedMuon", "FusedSGD", "dtensor_state_dict", "join_bf16_remainder", "muon_param_groups",
    "split_bf16_remainder",
]
