"""A pytest plugin (``-p aioloader_swap``, with this folder on ``PYTHONPATH``) that swaps torch's
``DataLoader`` for aioloader's before any test module is imported: what a user does by changing
the import, applied to a test file written for torch (``benchmarks/torch_tests.sh``)."""

import torch.utils.data

import aioloader

torch.utils.data.DataLoader = aioloader.DataLoader  # type: ignore[misc]
