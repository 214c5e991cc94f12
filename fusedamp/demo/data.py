"""FashionMNIST for the demo: a small IDX reader for the real files and a synthetic stand-in.

The real data set is read from the four standard IDX files (gzipped or raw) in a folder the
user names; nothing is downloaded. Without one, :func:`synthetic_fashion_mnist` draws
FashionMNIST-shaped data (1x28x28 uint8 images, 10 garment-like classes) that a network has
to learn: each class is a silhouette with randomized geometry, shading, texture and noise, and
the upper-body classes (T-shirt, pullover, coat, shirt) differ only in faint details, as in the
real set, so accuracy stays below 100% and means something.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = [
    "CLASSES",
    "IDXFormatError",
    "Split",
    "FashionMNIST",
    "read_idx",
    "load_fashion_mnist",
    "synthetic_fashion_mnist",
    "batches",
]

CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

# Standard file names of the FashionMNIST (and MNIST) distribution, without ".gz".
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

# IDX element type codes: (torch dtype, bytes per element). Multi-byte types are big-endian.
_IDX_TYPES = {
    0x08: (torch.uint8, 1),
    0x09: (torch.int8, 1),
    0x0B: (torch.int16, 2),
    0x0C: (torch.int32, 4),
    0x0D: (torch.float32, 4),
    0x0E: (torch.float64, 8),
}


class IDXFormatError(ValueError):
    """A file is not a well-formed IDX file (bad header, wrong size, broken gzip stream).

    >>> raise IDXFormatError("labels.idx: truncated header")
    Traceback (most recent call last):
    fusedamp.demo.data.IDXFormatError: labels.idx: truncated header
    """


def read_idx(path: str) -> Tensor:
    """The array stored in the IDX file ``path`` (gzipped when the name ends in ``.gz``).

    >>> read_idx("data/train-labels-idx1-ubyte.gz").shape
    torch.Size([60000])
    """
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as stream:
            raw = stream.read()
    except (OSError, EOFError) as error:  # gzip raises both for a damaged stream
        if isinstance(error, FileNotFoundError):
            raise
        raise IDXFormatError(f"{path}: cannot read the file: {error}") from error
    if len(raw) < 4:
        raise IDXFormatError(f"{path}: truncated header ({len(raw)} bytes)")
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _IDX_TYPES:
        raise IDXFormatError(
            f"{path}: not an IDX file (magic bytes {raw[:4].hex()}; expected 0000 then a type "
            f"code among {', '.join(f'{code:02x}' for code in _IDX_TYPES)})"
        )
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise IDXFormatError(f"{path}: truncated header: {ndim} dimensions announced")
    shape = struct.unpack(f">{ndim}I", raw[4:header_size])
    dtype, item_size = _IDX_TYPES[type_code]
    expected = math.prod(shape) * item_size
    if len(raw) - header_size != expected:
        raise IDXFormatError(
            f"{path}: shape {list(shape)} of {dtype} needs {expected} data bytes, "
            f"found {len(raw) - header_size}"
        )
    data = torch.frombuffer(bytearray(raw[header_size:]), dtype=torch.uint8)
    if item_size > 1 and sys.byteorder == "little":
        data = data.view(-1, item_size).flip(1).contiguous()
    return data.view(dtype).reshape(shape)


@dataclass
class Split:
    """Images (uint8, N x 28 x 28) and labels (int64, N) of one split.

    >>> split = Split(torch.zeros(2, 28, 28, dtype=torch.uint8), torch.tensor([0, 9]))
    >>> len(split)
    2
    """

    images: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class FashionMNIST:
    """Train and test splits plus where they came from (``"FashionMNIST (path)"`` or synthetic).

    >>> data = synthetic_fashion_mnist(100, 50)
    >>> len(data.train), len(data.test), data.synthetic
    (100, 50, True)
    """

    train: Split
    test: Split
    source: str
    synthetic: bool


def _find(data_dir: str, name: str) -> str | None:
    for folder in (data_dir, os.path.join(data_dir, "FashionMNIST", "raw")):
        for candidate in (name, name + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.exists(path):
                return path
    return None


def load_fashion_mnist(data_dir: str) -> FashionMNIST:
    """The real FashionMNIST from the standard IDX files in ``data_dir`` (or its
    ``FashionMNIST/raw`` subfolder, torchvision's layout), gzipped or not.

    >>> data = load_fashion_mnist("~/data/fashion")
    >>> data.train.images.shape
    torch.Size([60000, 28, 28])
    """
    data_dir = os.path.expanduser(data_dir)
    paths = {key: _find(data_dir, name) for key, name in FILES.items()}
    missing = [FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise FileNotFoundError(
            f"{data_dir} does not hold FashionMNIST: missing {', '.join(missing)} (.gz or raw). "
            "Put the four IDX files there, or leave out --data-dir to use the synthetic set."
        )
    splits = {}
    for split in ("train", "test"):
        images = read_idx(paths[f"{split}_images"])
        labels = read_idx(paths[f"{split}_labels"])
        if images.dtype != torch.uint8 or images.dim() != 3 or images.shape[1:] != (28, 28):
            raise IDXFormatError(
                f"{paths[f'{split}_images']}: expected uint8 images of 28x28, got {images.dtype} "
                f"of shape {list(images.shape)}"
            )
        if labels.dim() != 1 or len(labels) != len(images):
            raise IDXFormatError(
                f"{paths[f'{split}_labels']}: expected {len(images)} labels, one per image, "
                f"got shape {list(labels.shape)}"
            )
        labels = labels.long()
        if len(labels) and (labels.min() < 0 or labels.max() >= len(CLASSES)):
            raise IDXFormatError(f"{paths[f'{split}_labels']}: labels outside 0..9")
        splits[split] = Split(images, labels)
    return FashionMNIST(splits["train"], splits["test"], f"FashionMNIST ({data_dir})", False)


def _garments(labels: Tensor, generator: torch.Generator) -> Tensor:
    """Float silhouettes in [0, 1], one 28x28 image per label, with randomized geometry."""
    n = len(labels)

    def uniform(low: float, high: float) -> Tensor:
        return (low + (high - low) * torch.rand(n, 1, 1, generator=generator))

    yy = torch.arange(28.0).view(1, 28, 1)
    xx = torch.arange(28.0).view(1, 1, 28)
    cx = 13.5 + uniform(-2.0, 2.0)
    cy = uniform(-1.5, 1.5)  # vertical shift of the whole garment
    size = uniform(0.85, 1.1)
    x = (xx - cx) / size
    y = (yy - 14.0 - cy) / size + 14.0

    def box(x0: float | Tensor, x1: float | Tensor, y0: float | Tensor, y1: float | Tensor) -> Tensor:
        return ((x >= x0) & (x < x1) & (y >= y0) & (y < y1)).float()

    half_width = uniform(5.0, 7.5)
    torso = box(-half_width, half_width, 5.0, uniform(21.0, 25.0))
    sleeve_width = uniform(3.0, 4.5)
    long_sleeves = (box(-half_width - sleeve_width, -half_width, 5.5, uniform(13.0, 22.0))
                    + box(half_width, half_width + sleeve_width, 5.5, uniform(13.0, 22.0)))
    # Sleeve lengths of T-shirts and long-sleeved garments overlap a little: some samples are
    # ambiguous, as in the real set.
    short_sleeves = (box(-half_width - sleeve_width, -half_width, 5.5, uniform(8.5, 14.0))
                     + box(half_width, half_width + sleeve_width, 5.5, uniform(8.5, 14.0)))
    # Faint details that tell the upper-body classes apart, each with a random contrast.
    detail = uniform(0.1, 0.5)
    opening = box(-0.6, 0.6, 5.0, 26.0) * detail
    buttons = box(-0.8, 0.8, 5.0, 24.0) * (torch.remainder(y, 3.5) < 1.2).float() * detail
    collar = ((y - 5.0) < 2.5 - (x.abs() * 0.9)).float() * (y >= 5.0).float() * detail

    gap = uniform(0.5, 1.5)
    trouser = box(-6.0, 6.0, 3.0, 8.0) + box(-6.0, -gap, 8.0, 25.0) + box(gap, 6.0, 8.0, 25.0)
    flare = uniform(8.0, 11.0)
    dress = ((x.abs() < 3.5 + (flare - 3.5) * (y - 3.0) / 22.0) & (y >= 3.0) & (y < 25.0)).float()
    straps = (torch.remainder(y, 2.5) < 1.0).float() * box(-10.0, 10.0, 15.0, 21.0)
    sandal = box(-11.0, 11.0, 21.0, 23.5) + straps * (torch.remainder(x, 4.0) < 2.5).float()
    heel_height = uniform(11.0, 15.0)
    sneaker = box(-11.0, 11.0, 18.5, 24.0) + ((x > -11.0) & (x < 1.0) & (y >= heel_height)
                                               & (y < 18.5) & (y > heel_height + (x + 11.0) * 0.35)).float()
    handle = (((x / 6.0) ** 2 + ((y - 10.0) / 6.0) ** 2).sub(1.0).abs() < 0.25) & (y < 10.0)
    bag = box(-9.5, 9.5, 10.0, 24.0) + handle.float()
    boot = box(-10.0, -1.0, uniform(4.0, 8.0), 24.0) + box(-10.0, 10.0, 17.0, 24.0)

    shapes = torch.stack([
        torso + short_sleeves,                                      # T-shirt/top
        trouser,                                                    # Trouser
        torso + long_sleeves - collar * 0.5,                        # Pullover
        dress,                                                      # Dress
        box(-half_width, half_width, 4.0, 26.0) + long_sleeves - opening,  # Coat
        sandal,                                                     # Sandal
        torso + long_sleeves - collar - buttons,                    # Shirt
        sneaker,                                                    # Sneaker
        bag,                                                        # Bag
        boot,                                                       # Ankle boot
    ], dim=1)
    return shapes[torch.arange(n), labels].clamp(0.0, 1.0)


_CHUNK = 4096  # synthetic images drawn at a time


def synthetic_fashion_mnist(n_train: int = 12000, n_test: int = 2000, seed: int = 0) -> FashionMNIST:
    """A learnable FashionMNIST-shaped data set: balanced classes, uint8 28x28 images.

    >>> data = synthetic_fashion_mnist(1000, 200, seed=1)
    >>> data.train.images.dtype, data.train.images.shape
    (torch.uint8, torch.Size([1000, 28, 28]))
    """
    generator = torch.Generator().manual_seed(seed)
    total = n_train + n_test
    labels = torch.arange(total) % len(CLASSES)
    labels = labels[torch.randperm(total, generator=generator)]
    images = torch.empty(total, 28, 28, dtype=torch.uint8)
    # In chunks: the float intermediates of all 70,000 images at once would take ~6 GB.
    for start in range(0, total, _CHUNK):
        chunk = labels[start:start + _CHUNK]
        garments = _garments(chunk, generator)
        # Shading: a per-image brightness times a smooth texture (upsampled coarse noise), then
        # pixel noise; the background stays near black as in the real set.
        brightness = 0.45 + 0.55 * torch.rand(len(chunk), 1, 1, generator=generator)
        coarse = torch.rand(len(chunk), 1, 7, 7, generator=generator)
        texture = F.interpolate(coarse, size=(28, 28), mode="bilinear", align_corners=False)[:, 0]
        garments = garments * brightness * (0.6 + 0.4 * texture)
        garments = garments + 0.12 * torch.randn(garments.shape, generator=generator)
        images[start:start + _CHUNK] = (garments.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    train = Split(images[:n_train].contiguous(), labels[:n_train].contiguous())
    test = Split(images[n_train:].contiguous(), labels[n_train:].contiguous())
    return FashionMNIST(train, test, f"synthetic FashionMNIST-shaped data (seed {seed})", True)


# Mean and standard deviation of the real FashionMNIST training pixels (in [0, 1]).
MEAN, STD = 0.2860, 0.3530


def batches(
    split: Split,
    batch_size: int,
    *,
    device: torch.device | str = "cpu",
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Normalized float32 batches ``(N x 1 x 28 x 28, N)`` of ``split`` on ``device``.

    The whole split is small enough to index directly: no DataLoader workers to start.

    >>> x, y = next(batches(synthetic_fashion_mnist(64, 8).train, 32))
    >>> x.shape, y.shape
    (torch.Size([32, 1, 28, 28]), torch.Size([32]))
    """
    order = torch.randperm(len(split), generator=generator) if shuffle else torch.arange(len(split))
    stop = len(split) - len(split) % batch_size if drop_last else len(split)
    for start in range(0, stop, batch_size):
        index = order[start:start + batch_size]
        images = split.images[index].to(device, non_blocking=True)
        labels = split.labels[index].to(device, non_blocking=True)
        yield ((images.float() / 255.0 - MEAN) / STD).unsqueeze(1), labels
