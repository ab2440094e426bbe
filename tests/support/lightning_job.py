"""Lightning's ``Trainer.fit`` with DDP on two CPU ranks (gloo), run as a user runs it
(``python lightning_job.py OUT``: Lightning starts the second rank by running this script
again). Every configuration fits twice (3 epochs, with validation) through torch's
``DataLoader`` and through ``aioloader.DataLoader``, and each rank writes the samples it trained
and validated on, per epoch, to ``OUT/<config>-<rank>.json``."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import lightning as L
import torch

import aioloader

N = 64
EPOCHS = 3
LOADERS = {"torch": torch.utils.data.DataLoader, "aio": aioloader.DataLoader}


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


class AsyncNumbers(aioloader.AsyncDataset[torch.Tensor]):
    """The same samples, read in the loader's event loop (``await dataset.get(i)``)."""

    def __len__(self) -> int:
        return N

    async def get(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


async def stream() -> AsyncIterator[torch.Tensor]:
    """The same samples as a stream (an async generator function, called once an epoch)."""
    for index in range(N):
        yield torch.tensor([float(index)])


def loader(name: str, **kwargs: Any) -> Any:
    return LOADERS[name](Numbers(), batch_size=4, **kwargs)


class Recorder(L.LightningModule):
    def __init__(self, config: str, train: Any = None) -> None:
        super().__init__()
        self.config, self.train_loader = config, train
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[str, list[list[int]]] = {
            stage: [[] for _ in range(EPOCHS)] for stage in ("train", "val")
        }

    def record(self, stage: str, batch: torch.Tensor) -> None:
        self.seen[stage][self.current_epoch] += batch.flatten().int().tolist()

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        self.record("train", batch)
        return self.layer(batch).sum()

    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        self.record("val", batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> Any:  # made in the hook, as Lightning's docs show
        name, _, kind = self.config.partition("-")
        if kind == "workers":
            return loader(name, shuffle=True, num_workers=2)
        if kind == "distributed":  # already sharded: Lightning must not add a sampler
            return loader(name, shuffle=True, distributed=True)
        if kind == "async":  # an async map-style dataset: Lightning's sampler over it
            return aioloader.DataLoader(AsyncNumbers(), batch_size=4, shuffle=True)
        if kind == "stream":  # the README's way: Lightning adds no sampler, the loader shards
            return aioloader.DataLoader(stream, batch_size=4, distributed=True)
        made = loader(name, shuffle=True)
        # Set in the hook: Lightning records it and sets it again on the loader it rebuilds
        made.pin_memory = False
        return made

    def val_dataloader(self) -> Any:
        return loader(self.config.partition("-")[0])

    def on_train_end(self) -> None:
        with open(Path(sys.argv[1]) / f"{self.config}-{self.global_rank}.json", "w") as out:
            json.dump(self.seen, out)


def fit(config: str, train: Any = None, reload: int = 0, inject: bool = True) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        reload_dataloaders_every_n_epochs=reload,  # a new loader each epoch (made in the hook)
        use_distributed_sampler=inject,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Recorder(config)
    if train is None:
        trainer.fit(module)
    else:  # made before the trainer saw it: Lightning rebuilds it from vars(loader)
        trainer.fit(module, train_dataloaders=train)


if __name__ == "__main__":
    for name in LOADERS:
        fit(f"{name}-hook")
        fit(f"{name}-outside", loader(name, shuffle=True))
        fit(f"{name}-reload", reload=1)
    fit("aio-workers")
    fit("aio-async")
    fit("aio-stream", inject=False)
    fit("aio-distributed")
