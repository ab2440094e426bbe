"""A stateful sequence model fed stream per slot: position ``i`` of every batch continues
stream ``i``, so a GRU carries its hidden state from one batch to the next.

The data: 12 WebDataset shards in a temporary folder, each one "document" of token chunks
(``0007.tok`` holds chunk 7 of its shard). ``TarShards.per_slot(4)`` deals the shards to 4
streams; each batch holds the next chunk of every stream, and ``first`` says where a stream
began a new shard, so the model resets that position's state there.

Run: python examples/stateful_slots.py
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import tempfile
from pathlib import Path

import torch

import aioloader
from aioloader.sources import SlotSample, tar_shards

SLOTS, CHUNK, VOCAB = 4, 16, 50


def write_shards(root: Path, n_shards: int = 12) -> list[Path]:
    g = torch.Generator().manual_seed(0)
    paths = []
    for s in range(n_shards):
        path = root / f"doc-{s:02d}.tar"
        with tarfile.open(path, "w") as tar:
            for c in range(int(torch.randint(3, 8, (1,), generator=g))):
                data = torch.randint(0, VOCAB, (CHUNK,), generator=g, dtype=torch.uint8).numpy()
                info = tarfile.TarInfo(f"{c:04d}.tok")
                info.size = len(data.tobytes())
                tar.addfile(info, io.BytesIO(data.tobytes()))
        paths.append(path)
    return paths


def tokens(sample: SlotSample[dict[str, bytes]]) -> SlotSample[torch.Tensor]:
    """Decode a chunk (runs in the loader's workers)."""
    chunk = torch.frombuffer(bytearray(sample.sample["tok"]), dtype=torch.uint8).long()
    return sample._replace(sample=chunk)


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        shards = write_shards(Path(folder))
        dataset = tar_shards(shards, shuffle_shards=True, seed=0).per_slot(SLOTS)
        embed, gru = torch.nn.Embedding(VOCAB, 32), torch.nn.GRU(32, 32, batch_first=True)
        head = torch.nn.Linear(32, VOCAB)
        params = [*embed.parameters(), *gru.parameters(), *head.parameters()]
        opt = torch.optim.Adam(params, lr=1e-2)
        loader = aioloader.DataLoader(
            dataset, batch_size=SLOTS, transform=tokens, num_workers=1, worker_mode="thread"
        )
        async with loader:
            for epoch in range(3):
                hidden = torch.zeros(1, SLOTS, 32)
                losses = []
                async for batch in loader:
                    # A stream that starts a new shard starts a new document: reset its state.
                    hidden = hidden * (~batch.first).float().view(1, SLOTS, 1)
                    x = batch.sample
                    out, hidden = gru(embed(x[:, :-1]), hidden.detach())
                    loss = torch.nn.functional.cross_entropy(
                        head(out).reshape(-1, VOCAB), x[:, 1:].reshape(-1)
                    )
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                print(
                    f"epoch {epoch}: {len(losses)} batches of {SLOTS} streams, "
                    f"mean loss {sum(losses) / len(losses):.3f}"
                )


if __name__ == "__main__":
    asyncio.run(main())
