"""Lightning's mid-epoch resume, as a user runs it: ``python lightning_resume_job.py LOADERS
first OUT`` trains 23 steps of two 16-batch epochs and saves a checkpoint every 5 steps (the
one at step 20 is 4 batches into the second epoch); ``... LOADERS second OUT`` starts a new
process from that checkpoint and trains to the end. ``LOADERS`` names the loaders,
comma-separated: each is run in turn, with a checkpoint folder of its own. Lightning saves a
loader's ``state_dict()`` in its checkpoints, and loads it, when the loader has both methods.
Each run writes the batches it trained on to ``OUT/<loader>-<phase>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

import aioloader

LOADERS: dict[str, Any] = {
    "torch": torch.utils.data.DataLoader,  # keeps no state: the control
    "torchdata": StatefulDataLoader,
    "aio": aioloader.DataLoader,
}


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


class Recorder(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        self.seen.append(batch.flatten().int().tolist())
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> Any:
        workers = 2 if self.name == "aio" else 0  # ours with worker processes
        return LOADERS[self.name](Numbers(), batch_size=4, shuffle=True, num_workers=workers)


def run(name: str, phase: str, out: Path) -> None:
    checkpoints = out / f"checkpoints-{name}"
    module = Recorder(name)
    quiet: dict[str, Any] = {"logger": False, "enable_progress_bar": False}
    quiet["enable_model_summary"] = False
    if phase == "first":
        every5 = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=5, save_top_k=-1)
        trainer = L.Trainer(max_epochs=2, max_steps=23, callbacks=[every5], **quiet)
        trainer.fit(module)
    else:
        (step20,) = checkpoints.glob("*step=20.ckpt")
        trainer = L.Trainer(max_epochs=2, enable_checkpointing=False, **quiet)
        trainer.fit(module, ckpt_path=step20)
    (out / f"{name}-{phase}.json").write_text(json.dumps(module.seen))


if __name__ == "__main__":
    names, phase, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    for name in names.split(","):  # one process a phase: each loader's state is its own
        run(name, phase, out)
