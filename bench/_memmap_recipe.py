"""The np.memmap recipe every DataLoader bench compares against (bench/loader.py, bench/collate.py):
one flat uint8 file of 227x227x3 images (`flat.u8`) + `offsets.npy` + `labels.npy`; each sample
copies its slice out of the map, the way a user's hand-written Dataset does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from _common import SHAPE


class MemmapDataset(tud.Dataset):
    """The np.memmap recipe: one flat uint8 file + offsets; copy the slice out of the map."""

    def __init__(self, root: Path) -> None:
        self.path = root / "flat.u8"
        self.offsets = np.load(root / "offsets.npy")
        self.labels = np.load(root / "labels.npy")
        self.mm: np.memmap | None = None  # opened lazily, once per process

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.mm is None:
            self.mm = np.memmap(self.path, np.uint8, "r")
        a, b = self.offsets[i], self.offsets[i + 1]
        return {"image": torch.from_numpy(np.array(self.mm[a:b]).reshape(SHAPE)), "label": int(self.labels[i])}
