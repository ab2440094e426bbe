"""Tests for aioloader._data.padding: PadCollate, PaddedBatch and pad_collate."""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._data.padding import PadCollate, PaddedBatch, pad_collate
from tests.data.test_collate import _random_tensor, assert_same


def _expected_padding(
    samples: Sequence[torch.Tensor], padding_value: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padded values, lengths and mask, built one element at a time."""
    lengths = [s.shape[0] for s in samples]
    longest = max(lengths)
    rest = samples[0].shape[1:]
    values = torch.full((len(samples), longest, *rest), padding_value, dtype=samples[0].dtype)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for i, sample in enumerate(samples):
        for j in range(sample.shape[0]):
            values[i, j] = sample[j]
            mask[i, j] = True
    return values, torch.tensor(lengths, dtype=torch.int64), mask


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    rest=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8]),
    padding_value=st.integers(0, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_pad_collate_values_lengths_mask(
    lengths: list[int], rest: tuple[int, ...], dtype: torch.dtype, padding_value: int, seed: int
) -> None:
    samples = [_random_tensor(seed + i, (n, *rest), dtype) for i, n in enumerate(lengths)]
    result = PadCollate(padding_value=padding_value)(samples)
    values, expected_lengths, mask = _expected_padding(samples, padding_value)
    assert isinstance(result, PaddedBatch)
    assert_same(result.values, values)
    assert_same(result.lengths, expected_lengths)
    assert result.mask is not None
    assert_same(result.mask, mask)


def test_pad_collate_uses_padding_value_and_preserves_dtype() -> None:
    samples = [
        torch.tensor([1.0, 2.0], dtype=torch.float16),
        torch.tensor([3.0], dtype=torch.float16),
    ]
    result = PadCollate(padding_value=-0.5)(samples)
    assert result.values.dtype == torch.float16
    assert result.values.tolist() == [[1.0, 2.0], [3.0, -0.5]]
    assert result.lengths.tolist() == [2, 1]


def test_pad_collate_accepts_float_nan_padding() -> None:
    result = PadCollate(padding_value=float("nan"))([torch.ones(2), torch.ones(1)])
    assert torch.isnan(result.values[1, 1])


def test_pad_collate_numpy_samples() -> None:
    samples = [np.ones((3, 2), np.float32), np.zeros((1, 2), np.float32)]
    result = pad_collate(samples)
    assert result.values.dtype == torch.float32
    assert result.values.shape == (2, 3, 2)
    assert result.lengths.tolist() == [3, 1]


def test_pad_collate_without_mask() -> None:
    result = PadCollate(mask=False)([torch.ones(2), torch.ones(3)])
    assert result.mask is None
    assert result.values.shape == (2, 3)


def test_pad_collate_token_id_lists() -> None:
    result = PadCollate(padding_value=-1)([[5, 6, 7], [8], []])
    assert result.values.dtype == torch.int64
    assert result.values.tolist() == [[5, 6, 7], [8, -1, -1], [-1, -1, -1]]
    assert result.lengths.tolist() == [3, 1, 0]
    assert result.mask is not None
    assert result.mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]


def test_pad_collate_all_empty_sequences() -> None:
    result = pad_collate([torch.empty(0, 4), torch.empty(0, 4)])
    assert result.values.shape == (2, 0, 4)
    assert result.lengths.tolist() == [0, 0]


def test_pad_collate_mapping_samples_default_keys() -> None:
    batch = [
        {"audio": torch.ones(3, 2), "label": 1, "name": "a", "scalar": torch.tensor(1.0)},
        {"audio": torch.ones(5, 2), "label": 0, "name": "b", "scalar": torch.tensor(2.0)},
    ]
    result = pad_collate(batch)
    assert list(result) == ["audio", "label", "name", "scalar"]
    assert isinstance(result["audio"], PaddedBatch)
    assert result["audio"].values.shape == (2, 5, 2)
    assert result["audio"].lengths.tolist() == [3, 5]
    assert_same(result["label"], torch.tensor([1, 0]))
    assert result["name"] == ["a", "b"]
    assert_same(result["scalar"], torch.tensor([1.0, 2.0]))  # 0-d: collated, not padded


def test_pad_collate_mapping_samples_with_keys() -> None:
    batch = [
        {"ids": [1, 2, 3], "feats": torch.ones(4), "label": 1},
        {"ids": [4], "feats": torch.zeros(4), "label": 0},
    ]
    collate = PadCollate(keys=["ids"], padding_value=0)
    result = collate(batch)
    assert isinstance(result["ids"], PaddedBatch)
    assert result["ids"].values.tolist() == [[1, 2, 3], [4, 0, 0]]
    # "feats" is not in keys, so it is collated with default_collate (stacked), not padded.
    assert_same(result["feats"], torch.stack([torch.ones(4), torch.zeros(4)]))
    assert_same(result["label"], torch.tensor([1, 0]))


def test_pad_collate_keeps_mapping_type() -> None:
    batch = [collections.OrderedDict(x=torch.ones(2)), collections.OrderedDict(x=torch.ones(1))]
    result = pad_collate(batch)
    assert type(result) is collections.OrderedDict
    assert isinstance(result["x"], PaddedBatch)


def test_pad_collate_mismatched_trailing_shapes() -> None:
    with pytest.raises(
        ValueError, match=r"sample 0 has shape \(2, 3\).*sample 1 has shape \(4, 2\)"
    ):
        pad_collate([torch.zeros(2, 3), torch.zeros(4, 2)])


def test_pad_collate_missing_key() -> None:
    collate = PadCollate(keys=["ids"])
    with pytest.raises(KeyError, match=r"sample 1 has no key 'ids'"):
        collate([{"ids": [1]}, {"other": [2]}])


def test_pad_collate_zero_dim() -> None:
    with pytest.raises(ValueError, match=r"0-d.*sample 1"):
        pad_collate([torch.ones(2), torch.tensor(1.0)])
    with pytest.raises(ValueError, match="0-d"):
        PadCollate(keys=["x"])([{"x": torch.tensor(1)}, {"x": torch.tensor(2)}])


def test_pad_collate_mismatched_dtypes() -> None:
    with pytest.raises(TypeError, match=r"sample 0 has torch.float32 and sample 2 has torch.int64"):
        pad_collate([torch.ones(2), torch.ones(1), torch.ones(3, dtype=torch.int64)])


def test_pad_collate_rejects_non_sequences() -> None:
    with pytest.raises(TypeError, match=r"sample 1"):
        pad_collate([[1, 2], [1.5]])
    with pytest.raises(TypeError, match="cannot pad"):
        pad_collate(["ab", "c"])


def test_pad_collate_empty_batch() -> None:
    with pytest.raises(ValueError, match="cannot collate an empty batch"):
        pad_collate([])


def test_pad_collate_keys_given_for_bare_samples() -> None:
    with pytest.raises(TypeError, match="not a mapping"):
        PadCollate(keys=["x"])([torch.ones(2)])


def test_pad_collate_fractional_padding_for_integer_dtype() -> None:
    with pytest.raises(ValueError, match="padding_value"):
        PadCollate(padding_value=0.5)([[1, 2], [3]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keys": "ids"}, "collection of key names"),
        ({"keys": [1]}, "strings"),
        ({"padding_value": "0"}, "padding_value"),
        ({"padding_value": None}, "padding_value"),
        ({"mask": 1}, "mask"),
    ],
)
def test_pad_collate_argument_checks(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        PadCollate(**kwargs)


def test_pad_collate_repr() -> None:
    assert repr(PadCollate()) == "PadCollate(padding_value=0, keys=None, mask=True)"
    assert (
        repr(PadCollate(padding_value=-1.0, keys={"b", "a"}, mask=False))
        == "PadCollate(padding_value=-1.0, keys=['a', 'b'], mask=False)"
    )


@pytest.mark.parametrize(
    "collate",
    [pad_collate, PadCollate(padding_value=-1, keys=["ids"], mask=False)],
    ids=repr,
)
def test_pad_collate_pickles(collate: PadCollate) -> None:
    clone = pickle.loads(pickle.dumps(collate))
    assert clone == collate
    assert hash(clone) == hash(collate)
    assert repr(clone) == repr(collate)
    batch = [{"ids": [1, 2], "y": 1}, {"ids": [3], "y": 2}]
    if collate.keys is None:
        batch = [{"ids": torch.tensor(s["ids"]), "y": s["y"]} for s in batch]
    assert_same(clone(batch), collate(batch))


def test_pad_collate_equality() -> None:
    assert PadCollate(keys=["a", "b"]) == PadCollate(keys=("b", "a"))
    assert PadCollate(padding_value=1) != PadCollate(padding_value=2)
    assert PadCollate() != object()


def _call(collate: Callable[[Any], Any], batch: Any) -> Any:
    return collate(batch)


def test_pad_collate_is_a_plain_callable() -> None:
    result = _call(pad_collate, [torch.ones(1), torch.ones(2)])
    assert isinstance(result, PaddedBatch)
