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
    ],
)
def test_a_slice_counts_what_its_samples_count(samples: list[Any]) -> None:
    assert nbytes_of_all(samples) == sum(map(nbytes_of, samples))
