"""Train from a high-latency source with ``async for``: the loader keeps 128 reads in flight,
so 20 ms per read still feeds the model thousands of samples a second.

Run: python examples/remote_training.py
"""

from __future__ import annotations

import asyncio

import torch

import aioloader


class SlowStore(aioloader.AsyncDataset[bytes]):
    """Stands in for an object store: every read takes 20 ms of network latency."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.throttled: set[int] = set()

    def __len__(self) -> int:
        return self.n

    async def get(self, index: int) -> bytes:
        await asyncio.sleep(0.02)
        if index % 97 == 13 and index not in self.throttled:  # throttled once, now and then
            self.throttled.add(index)
            raise aioloader.TransientError(f"503 SlowDown for object {index}")
        return index.to_bytes(4, "little") * 16


def decode(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).float()


async def main() -> None:
    loader = aioloader.DataLoader(
        SlowStore(4096),
        batch_size=64,
        shuffle=True,
        seed=0,
        transform=decode,
        max_inflight=128,
        prefetch=4,
        retry=aioloader.RetryPolicy(attempts=4, initial_backoff=0.01),
        sample_timeout=1.0,
    )
    model = torch.nn.Linear(16, 1)
    async with loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            async for batch in loader:
                model(batch).sum().backward()
    print(loader.statistics())


if __name__ == "__main__":
    asyncio.run(main())
