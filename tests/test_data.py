"""The IDX reader (on generated files, raw and gzipped, and corrupt ones), the FashionMNIST
loader, the synthetic data set and the batch iterator."""

import gzip
import struct

import pytest
import torch

from fusedamp.demo.data import (
    CLASSES,
    FILES,
    MEAN,
    STD,
    IDXFormatError,
    batches,
    load_fashion_mnist,
    read_idx,
    synthetic_fashion_mnist,
)

TYPE_CODES = {
    torch.uint8: 0x08,
    torch.int8: 0x09,
    torch.int16: 0x0B,
    torch.int32: 0x0C,
    torch.float32: 0x0D,
    torch.float64: 0x0E,
}
STRUCT_CODES = {
    torch.uint8: "B",
    torch.int8: "b",
    torch.int16: "h",
    torch.int32: "i",
    torch.float32: "f",
    torch.float64: "d",
}


def idx_bytes(values: torch.Tensor) -> bytes:
    """An IDX file written the way the format describes it, independently of read_idx."""
    header = struct.pack(">HBB", 0, TYPE_CODES[values.dtype], values.dim())
    header += struct.pack(f">{values.dim()}I", *values.shape)
    flat = values.flatten().tolist()
    return header + struct.pack(f">{len(flat)}{STRUCT_CODES[values.dtype]}", *flat)


def write(path, payload: bytes) -> str:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as out:
        out.write(payload)
    return str(path)


@pytest.mark.parametrize("dtype", list(TYPE_CODES))
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_round_trips_every_type(tmp_path, dtype, suffix):
    generator = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        values = torch.randn(3, 4, 5, generator=generator).to(dtype)
    else:
        info = torch.iinfo(dtype)
        values = torch.randint(info.min, info.max, (3, 4, 5), generator=generator, dtype=torch.int64)
        values = values.to(dtype)
    path = write(tmp_path / f"values.idx{suffix}", idx_bytes(values))
    loaded = read_idx(path)
    assert loaded.dtype == dtype
    assert torch.equal(loaded, values)


def test_read_idx_one_dimensional_labels(tmp_path):
    labels = torch.tensor([9, 0, 3, 3], dtype=torch.uint8)
    assert torch.equal(read_idx(write(tmp_path / "labels", idx_bytes(labels))), labels)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x00\x00", "truncated header"),
        (b"\x12\x34\x08\x01" + struct.pack(">I", 1) + b"\x00", "not an IDX file"),
        (b"\x00\x00\x07\x01" + struct.pack(">I", 1) + b"\x00", "not an IDX file"),
        (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated header"),
        (b"\x00\x00\x08\x02" + struct.pack(">II", 2, 3) + b"\x00" * 5, "needs 6 data bytes, found 5"),
        (b"\x00\x00\x08\x01" + struct.pack(">I", 2) + b"\x00" * 3, "needs 2 data bytes, found 3"),
        (b"\x00\x00\x0c\x01" + struct.pack(">I", 2) + b"\x00" * 7, "needs 8 data bytes, found 7"),
    ],
)
def test_read_idx_rejects_corrupt_files(tmp_path, payload, message):
    path = write(tmp_path / "bad.idx", payload)
    with pytest.raises(IDXFormatError, match=message):
        read_idx(path)


def test_read_idx_rejects_broken_gzip(tmp_path):
    good = gzip.compress(idx_bytes(torch.arange(100, dtype=torch.uint8)))
    path = tmp_path / "broken.gz"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(IDXFormatError, match="cannot read"):
        read_idx(str(path))
    path.write_bytes(b"definitely not gzip")
    with pytest.raises(IDXFormatError, match="cannot read"):
        read_idx(str(path))


def test_read_idx_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_idx(str(tmp_path / "absent.gz"))


def write_fashion_mnist(folder, n_train=12, n_test=5, gz=True, labels_dtype=torch.uint8):
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    data = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), generator=generator, dtype=torch.int64).to(torch.uint8)
        labels = torch.randint(0, 10, (n,), generator=generator, dtype=torch.int64).to(labels_dtype)
        for kind, values in (("images", images), ("labels", labels)):
            write(folder / (FILES[f"{split}_{kind}"] + (".gz" if gz else "")), idx_bytes(values))
        data[split] = (images, labels.long())
    return data


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("torchvision_layout", [False, True])
def test_load_fashion_mnist(tmp_path, gz, torchvision_layout):
    folder = tmp_path / "FashionMNIST" / "raw" if torchvision_layout else tmp_path
    expected = write_fashion_mnist(folder, gz=gz)
    data = load_fashion_mnist(str(tmp_path))
    assert not data.synthetic and str(tmp_path) in data.source
    for split in ("train", "test"):
        images, labels = expected[split]
        assert torch.equal(getattr(data, split).images, images)
        assert torch.equal(getattr(data, split).labels, labels)
        assert getattr(data, split).labels.dtype == torch.int64


def test_load_fashion_mnist_names_missing_files(tmp_path):
    write_fashion_mnist(tmp_path)
    (tmp_path / (FILES["test_labels"] + ".gz")).unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_fashion_mnist(str(tmp_path))


def test_load_fashion_mnist_rejects_inconsistent_files(tmp_path):
    write_fashion_mnist(tmp_path)
    write(tmp_path / (FILES["train_labels"] + ".gz"), idx_bytes(torch.zeros(3, dtype=torch.uint8)))
    with pytest.raises(IDXFormatError, match="expected 12 labels"):
        load_fashion_mnist(str(tmp_path))
    write(tmp_path / (FILES["train_labels"] + ".gz"), idx_bytes(torch.full((12,), 10, dtype=torch.uint8)))
    with pytest.raises(IDXFormatError, match="outside 0..9"):
        load_fashion_mnist(str(tmp_path))
    write(tmp_path / (FILES["train_images"] + ".gz"), idx_bytes(torch.zeros(12, 28, 27, dtype=torch.uint8)))
    with pytest.raises(IDXFormatError, match="28x28"):
        load_fashion_mnist(str(tmp_path))


def test_synthetic_set_shape_balance_and_determinism():
    data = synthetic_fashion_mnist(500, 100, seed=3)
    assert data.synthetic and "synthetic" in data.source
    assert data.train.images.shape == (500, 28, 28) and data.train.images.dtype == torch.uint8
    assert data.test.images.shape == (100, 28, 28)
    all_labels = torch.cat([data.train.labels, data.test.labels])
    assert torch.equal(torch.bincount(all_labels, minlength=10), torch.full((10,), 60))
    again = synthetic_fashion_mnist(500, 100, seed=3)
    assert torch.equal(again.train.images, data.train.images)
    assert not torch.equal(synthetic_fashion_mnist(500, 100, seed=4).train.images, data.train.images)


def test_synthetic_set_is_learnable_but_not_trivial():
    # A linear classifier (ridge regression on one-hot targets) must beat chance by far, yet a
    # nearest-class-mean one must not be perfect: the classes overlap like the real ones do.
    data = synthetic_fashion_mnist(3000, 1000, seed=0)
    features = lambda split: torch.cat(  # noqa: E731
        [split.images.flatten(1).double() / 255.0, torch.ones(len(split), 1, dtype=torch.float64)], 1
    )
    targets = torch.nn.functional.one_hot(data.train.labels, len(CLASSES)).double()
    x = features(data.train)
    weights = torch.linalg.solve(x.T @ x + 1e-3 * torch.eye(x.shape[1], dtype=x.dtype), x.T @ targets)
    linear_accuracy = (features(data.test) @ weights).argmax(1).eq(data.test.labels).double().mean()
    means = torch.stack(
        [data.train.images[data.train.labels == c].flatten(1).double().mean(0) for c in range(len(CLASSES))]
    )
    nearest = torch.cdist(data.test.images.flatten(1).double(), means).argmin(1)
    nearest_accuracy = nearest.eq(data.test.labels).double().mean()
    assert linear_accuracy > 0.5
    assert nearest_accuracy < 0.95


def test_batches_normalize_and_cover_the_split():
    data = synthetic_fashion_mnist(70, 10)
    seen = []
    for images, labels in batches(data.train, 32):
        assert images.dtype == torch.float32 and images.shape[1:] == (1, 28, 28)
        seen.append(labels)
    assert [len(s) for s in seen] == [32, 32, 6]
    assert torch.equal(torch.cat(seen), data.train.labels)
    first, _ = next(batches(data.train, 4))
    expected = (data.train.images[:4].float() / 255.0 - MEAN) / STD
    torch.testing.assert_close(first[:, 0], expected)


def test_batches_shuffle_is_seeded_and_drop_last_drops():
    data = synthetic_fashion_mnist(70, 10)

    def order(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.cat(
            [y for _, y in batches(data.train, 16, shuffle=True, generator=generator, drop_last=True)]
        )

    assert len(order(0)) == 64
    assert torch.equal(order(0), order(0))
    assert not torch.equal(order(0), order(1))
