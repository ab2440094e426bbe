"""ImageFolder-style training: class folders of JPEGs, each label from its folder's name.

The script writes a small tree to a temporary folder (``<class>/<n>.jpg``: three classes, each
image a noisy picture whose dominant colour is its class), then trains a small model on it.
``aioloader.sources.files(root, suffix=".jpg", with_keys=True)`` lists the tree once and gives
each file as ``(relative path, bytes)``; two worker processes read the files (they are sent
indices, as torch's workers are) and run the JPEG decode (Pillow) and a random flip (NumPy),
seeded per batch from ``seed``, so a rerun sees the same augmentations; the label is the path's
first part, as torchvision's ``ImageFolder`` reads it.

Run: python examples/image_folder.py
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from aioloader import DataLoader
from aioloader.sources import files

CLASSES = ("blue", "green", "red")  # sorted, as ImageFolder sorts its class folders
PER_CLASS, SIZE = 200, 32


def write_tree(root: Path) -> None:
    rng = np.random.default_rng(0)
    for channel, name in ((2, "blue"), (1, "green"), (0, "red")):
        (root / name).mkdir()
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 110, (SIZE, SIZE, 3), dtype=np.uint8)
            pixels[..., channel] += 120
            Image.fromarray(pixels).save(root / name / f"{i:04d}.jpg", quality=90)


def decode(item: tuple[str, bytes]) -> tuple[torch.Tensor, int]:
    """In a worker: JPEG bytes to a float tensor, flipped half the time; the label from the
    folder's name."""
    key, data = item
    pixels = np.array(Image.open(io.BytesIO(data)).convert("RGB"))  # a writable copy
    if np.random.random() < 0.5:  # seeded per batch by the loader
        pixels = pixels[:, ::-1]
    image = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float() / 255
    return image, CLASSES.index(key.split("/", 1)[0])


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="aioloader-images-") as tmp:
        root = Path(tmp)
        write_tree(root)
        loader = DataLoader(
            files(root, suffix=".jpg", with_keys=True),
            batch_size=32,
            shuffle=True,
            seed=0,
            transform=decode,
            num_workers=2,
            persistent_workers=True,
        )
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, len(CLASSES)),
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        print(f"{len(loader.dataset)} images in {len(CLASSES)} classes: {', '.join(CLASSES)}")
        for epoch in range(3):
            correct = seen = 0
            for images, labels in loader:
                logits = model(images)
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                correct += int((logits.argmax(1) == labels).sum())
                seen += len(labels)
            print(f"epoch {epoch}: accuracy {correct / seen:.1%}")
        loader.close()


if __name__ == "__main__":
    main()
