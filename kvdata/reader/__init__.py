"""The reader layer: open by path or URL, the daemon client, and the PyTorch side.

`open_dataset` (kvdata.open) is the one way every entry point opens a dataset.
`dataset`, `sampler` and `batch_reader` import torch / serve training loops; this
package's `__init__` imports none of them, so `import kvdata` stays torch-free.
"""

from .open import open_dataset, verify

__all__ = ["open_dataset", "verify"]
