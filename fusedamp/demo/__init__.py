"""fusedamp's main job: train a ResNet on FashionMNIST in fp32 and in mixed precision, compare.

    python -m fusedamp.demo                      # ends within ~2 minutes on any 2-core machine
    python -m fusedamp.demo --preset seed        # the seed experiment, beside its published figures
    python -m fusedamp.demo --data-dir ~/fashion --model resnet50 --epochs 10 --plot amp.png

Not part of the library (``import fusedamp`` does not load it). Modes (``--modes``,
comma-separated; all four by default):

- ``fp32``: plain fp32 training, ``torch.optim.AdamW(fused=True)``;
- ``torch-amp``: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``;
- ``fusedamp``: ``fusedamp.autocast`` + ``fusedamp.GradScaler`` + ``fusedamp.FusedAdamW``;
- ``fusedamp-o2``: the model itself in half precision (``fusedamp.half_model``, BatchNorm kept
  fp32) + ``fusedamp.GradScaler`` + ``FusedAdamW`` with fp32 master weights.

Every mode starts from the same weights and sees the batches in the same order; the modes take
turns epoch by epoch, so a shared machine's load hits all of them alike. The header says what
the hardware computes natively in bf16/fp16 (:mod:`fusedamp.demo.hardware`). Unless
``--epochs`` is given, a time budget (``--time-budget``, :mod:`fusedamp.demo.budget`) sizes the
run from warm-up measurements. The final table gives time per epoch, throughput, the speedup
over fp32 (median over the epochs and its range), peak memory, test accuracy and macro
precision/recall/F1, the fraction of gradients fp16 would flush to zero without loss scaling,
skipped steps and the final loss scale; then the hardware's part in the result and gradient
advice. ``--json`` writes everything, ``--plot`` draws loss curves, loss-scale history and the
underflow fraction per step (needs matplotlib).

Modules: ``cli`` (options, presets, output), ``train`` (recipes, the modes taking turns),
``budget`` (warm-up and sizing), ``hardware``, ``report`` (table, seed figures, plot), ``data``
(FashionMNIST reader, synthetic set), ``models`` (ResNets).
"""

from fusedamp.demo.cli import main

__all__ = ["main"]
