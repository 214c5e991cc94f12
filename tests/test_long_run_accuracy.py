"""Coded optimizer states over long runs: a bf16 or 8-bit moment (or momentum buffer) must track
its fp32 value for 10^4 steps, not only for the few steps a unit test usually takes.

Each run is measured as the projection of the params' displacement on the fp32
optimizer's displacement: sum(d * d_ref) / sum(d_ref^2), 1.0 when the steps are the same. Round to
nearest froze the second moment (a change of (1 - beta2) of its distance to g^2 is far below half a
code step): the int8 run then moved 2.5x as far as AdamW after 3000 steps. Every config lives in
one optimizer as its own param group, so the whole grid is one run of 10^4 steps.
"""

from __future__ import annotations

import itertools

import torch

import fusedamp

NUMEL = 4096  # per gradient kind: each param holds a steady half and a noisy half
STEPS = 10_000
CHECKPOINTS = (200, 1000, 3000, 10_000)
TOLERANCE = 0.03
BETA2S = (0.95, 0.999, 0.9999)
LRS = (1e-5, 1e-3)
NOISES = (0.0, 0.5)  # a steady gradient (a fixed sign per element) and a noisy one
# (param dtype, master_weights) of the fusedamp runs: fp32 params and bf16 params with each master.
PARAM_MODES = (
    (torch.float32, True),
    (torch.bfloat16, True),
    (torch.bfloat16, "remainder"),
    (torch.bfloat16, "stochastic"),
)


def _start(dtype: torch.dtype) -> torch.Tensor:
    # bf16-representable starting values (so that every run starts where its reference does),
    # small enough that a bf16 ulp is far below the displacement even at lr=1e-5.
    generator = torch.Generator().manual_seed(1)
    return (0.01 * torch.randn(len(NOISES) * NUMEL, generator=generator)).bfloat16().to(dtype)


def _observed(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> torch.Tensor:
    """The fp32 value a run holds: the master where there is one, else the param."""
    if param.dtype == torch.float32 or group["master_weights"] == "stochastic":
        return param.detach().double()
    return opt.master_of(param).double()


def _long_run(optimizer: str, moments_modes: tuple[str, ...]) -> dict[tuple, dict[int, float]]:
    """The projection at each checkpoint of every (moments, param mode, beta2, lr, noise) config;
    for SGD, beta2 is the momentum. fp32 params move in proportion to lr, so they run at one lr."""
    groups_of = [
        (moments, mode, beta2, lr)
        for moments, mode, beta2, lr in itertools.product(moments_modes, PARAM_MODES, BETA2S, LRS)
        if mode[0] != torch.float32 or lr == LRS[-1]
    ]
    references = list(itertools.product(BETA2S, LRS))

    def options(beta2: float, lr: float) -> dict:
        if optimizer == "adamw":
            return {"lr": lr, "betas": (0.9, beta2), "weight_decay": 0.0}
        return {"lr": lr, "momentum": beta2}

    ref_params = [torch.nn.Parameter(_start(torch.float32)) for _ in references]
    reference_class = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    ref_opt = reference_class(
        [{"params": [p], **options(beta2, lr)} for p, (beta2, lr) in zip(ref_params, references, strict=True)]
    )
    params = [torch.nn.Parameter(_start(dtype)) for _, (dtype, _), _, _ in groups_of]
    fused_class = fusedamp.FusedAdamW if optimizer == "adamw" else fusedamp.FusedSGD
    opt = fused_class(
        [
            {"params": [p], "moments": moments, "master_weights": master, **options(beta2, lr)}
            for p, (moments, (_, master), beta2, lr) in zip(params, groups_of, strict=True)
        ],
        seed=3,
    )
    ref_start = _start(torch.float32).double()
    generator = torch.Generator().manual_seed(2)
    signs = torch.randint(0, 2, (NUMEL,), generator=generator).float() * 2 - 1
    ratios: dict[tuple, dict[int, float]] = {}
    for step in range(1, STEPS + 1):
        noise = torch.randn(NUMEL, generator=generator)
        grad = torch.cat([signs + level * noise for level in NOISES])
        for p in ref_params:
            p.grad = grad
        ref_opt.step()
        for param in params:
            param.grad = grad.to(param.dtype, copy=True)
        opt.step()
        if step not in CHECKPOINTS:
            continue
        for param, group, config in zip(params, opt.param_groups, groups_of, strict=True):
            ref = (ref_params[references.index(config[2:])].detach().double() - ref_start).view(
                len(NOISES), NUMEL
            )
            moved = (_observed(opt, group, param) - ref_start).view(len(NOISES), NUMEL)
            for level, d, d_ref in zip(NOISES, moved, ref, strict=True):
                ratios.setdefault((*config, level), {})[step] = float(
                    (d * d_ref).sum() / (d_ref * d_ref).sum()
                )
    return ratios


def _off_target(ratios: dict[tuple, dict[int, float]]) -> list[str]:
    return [
        f"{config}: step {step} projection {ratio:.4f}"
        for config, by_step in ratios.items()
        for step, ratio in by_step.items()
        if abs(ratio - 1.0) > TOLERANCE
    ]


def test_adamw_coded_moments_track_fp32_over_ten_thousand_steps() -> None:
    ratios = _long_run("adamw", ("int8", "bf16"))
    # 2 moment codecs x (3 bf16 modes x 2 lrs + fp32 params) x 3 beta2s x 2 gradients.
    assert len(ratios) == 2 * 7 * 3 * 2
    assert all(len(by_step) == len(CHECKPOINTS) for by_step in ratios.values())
    assert not _off_target(ratios), "\n".join(_off_target(ratios))


def test_sgd_coded_momentum_tracks_fp32_over_ten_thousand_steps() -> None:
    # The momentum plays beta2's part: 0.95, 0.999 and 0.9999.
    ratios = _long_run("sgd", ("int8", "bf16"))
    assert len(ratios) == 2 * 7 * 3 * 2
    assert not _off_target(ratios), "\n".join(_off_target(ratios))
