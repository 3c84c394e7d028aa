"""kvdata: a dataset store for ML training.

Samples live as uncompressed records in LMDB shards with a numpy memmap
side-index, so a batch read is a few vectorized lookups and one copy per sample.
torch and S3 SDKs are imported lazily: ``import kvdata`` needs neither.
"""

from __future__ import annotations

from typing import Any

from .errors import KVDataError
from .reader.open import open_dataset as open
from .store import Store
from .store.compact import CompactSummary, compact
from .sync.home_merge import merge

__all__ = ["open", "Store", "KVDataError", "merge", "compact", "CompactSummary", "Dataset", "ShardShuffleSampler",
           "collate", "BatchReader", "Loader",
           "Ragged", "from_iterable", "from_arrays", "__version__"]
__version__ = "0.1.0"

_LAZY = {
    "Dataset": ("reader.dataset", "Dataset"),
    "collate": ("reader.dataset", "collate"),
    "ShardShuffleSampler": ("reader.sampler", "ShardShuffleSampler"),
    "BatchReader": ("reader.batch_reader", "BatchReader"),
    "Loader": ("reader.loader", "Loader"),
    "Ragged": ("store.stacking", "Ragged"),
    "from_iterable": ("importers.python", "from_iterable"),
    "from_arrays": ("importers.python", "from_arrays"),
}


def __getattr__(name: str) -> Any:
    """Load the torch-based names (and the importers) on first use, so `import kvdata` never imports torch."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        try:
            loaded = importlib.import_module(f".{module}", __name__)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "torch":
                raise
            raise ModuleNotFoundError(f"kvdata.{name} needs PyTorch, which is not installed: pip install 'kvdata[torch]' "
                                      f"(or install the torch build you use, any release >= 2.1)", name="torch") from None
        return getattr(loaded, attr)
    raise AttributeError(f"module 'kvdata' has no attribute {name!r}")
