"""A slice's bytes counted at once (``_pipeline/flow.py``) equal them counted one by one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from aioloader._pipeline.flow import nbytes_of, nbytes_of_all


@pytest.mark.parametrize(
    "samples",
    [
        [],
        [torch.zeros(4), torch.zeros(2, dtype=torch.float64)],
        [np.zeros(3), torch.zeros(1)],
        [b"ab", bytearray(b"c")],
        [b"ab", "cd"],  # not all bytes: one by one
        [torch.zeros(4), {"a": torch.zeros(2)}],  # not all with an nbytes: one by one
        [None, torch.zeros(2)],
        [torch.zeros(2), None],
        [{"x": b"abc"}, [b"de"]],
        [1, 2, 3],
        [1.5, True, None],
        ["ab", "cde"],
        [bytearray(b"xy"), bytearray(b"z")],
        [np.int64(3), np.float32(2.0)],  # numpy scalars have an nbytes
        [{"id": 1, "label": 2}, {"id": 3, "label": 4}],
        [{"x": torch.zeros(3), "s": "abc", "n": None}, {"x": torch.zeros(1), "s": "", "n": 2}],
        [(torch.zeros(2), 1), (torch.zeros(3), 2)],
        [[b"ab", [b"c", {"d": b"ef"}]], [b"g"]],
        [memoryview(b"abcd"), memoryview(b"e")],
    ],
)
def test_a_slice_counts_what_its_samples_count(samples: list[Any]) -> None:
    assert nbytes_of_all(samples) == sum(map(nbytes_of, samples))


def test_what_a_slice_counts() -> None:
    """The numbers themselves: data bytes of buffers, arrays and tensors, the length of a
    string, members of containers, nothing for numbers and None."""
    rows = [{"id": i, "label": i % 10, "score": 0.5, "none": None} for i in range(4)]
    assert nbytes_of_all(rows) == 0
    assert nbytes_of_all([{"x": torch.zeros(3), "name": "abc"}] * 2) == 2 * (12 + 3)
    assert nbytes_of_all([(np.zeros(2), b"xyz"), (np.zeros(1), b"")]) == 16 + 3 + 8
    assert nbytes_of_all([memoryview(np.zeros(4, dtype=np.int32))]) == 16
    assert nbytes_of_all([[b"ab", [b"c", {"d": bytearray(b"ef")}]], [b"g"]]) == 6
