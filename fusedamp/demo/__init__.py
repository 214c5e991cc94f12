"""fusedamp's main job: train a ResNet on FashionMNIST in fp32 and in mixed precision, compare.

    python -m fusedamp.demo                      # sized to end within ~2.5 minutes on any 2-core machine
    python -m fusedamp.demo --preset seed        # the seed experiment, beside its published figures
    python -m fusedamp.demo --data-dir ~/fashion --model resnet50 --epochs 10 --plot amp.png

Not part of the library (``import fusedamp`` does not load it). Modes (``--modes``,
comma-separated; all five by default):

- ``fp32``: plain fp32 training, ``torch.optim.AdamW(fused=True)``;
- ``torch-amp``: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``;
- ``fusedamp``: ``fusedamp.autocast`` + ``fusedamp.GradScaler`` + ``fusedamp.FusedAdamW``;
- ``fusedamp-o2``: the model itself in half precision (``fusedamp.half_model``, BatchNorm kept
  fp32) + ``fusedamp.GradScaler`` + ``FusedAdamW`` with fp32 master weights;
- ``fusedamp-lowmem``: the model in bf16 (BatchNorm kept fp32), ``FusedAdamW`` with bf16
  remainder masters (an exact fp32 master for 2 bytes) and int8 moments: weights, grads and
  optimizer state in half of fp32 training's bytes, the optimizer state a third of O2's.

Every mode starts from the same weights and sees the batches in the same order; the modes take
turns epoch by epoch, so a shared machine's load hits all of them alike. The header says what
the hardware computes natively in bf16/fp16 (:mod:`fusedamp.demo.hardware`). Unless
``--epochs`` is given, a time budget (``--time-budget``, :mod:`fusedamp.demo.budget`) sizes the
run from warm-up measurements: the model and batch size (the largest that gives every mode
the steps it needs to learn), the samples per epoch and the epochs. The final table gives
optimizer steps, time per epoch, throughput, the speedup over fp32 (median over the epochs and
its range), the optimizer step's time, test accuracy and macro precision/recall/F1, the
fraction of gradients fp16 would flush to zero without loss scaling, skipped steps and the
final loss scale; then the memory table (:mod:`fusedamp.demo.memory`: weights, grads,
optimizer state, saved activations per mode), what the run shows whatever the hardware's
speed, the hardware's part in the result and gradient advice. ``--json`` writes everything,
``--plot`` draws loss curves, loss-scale history and the underflow fraction per step (needs
matplotlib).

Modules: ``cli`` (options, presets, output), ``train`` (recipes, the modes taking turns),
``budget`` (warm-up and sizing), ``hardware``, ``memory`` (bytes per mode from the tensors),
``report`` (tables, findings, seed figures, plot), ``data`` (FashionMNIST reader, synthetic
set), ``models`` (ResNets).
"""

from fusedamp.demo.cli import main

__all__ = ["main"]
