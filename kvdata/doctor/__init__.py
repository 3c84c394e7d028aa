"""The doctor: what this box can feed a training job (`kvdata doctor`), measured link by link
(measure.py), and which link caps a needed rate, in words (diagnose.py).

Diagnostics, not the read path: a package above the reader (it reads through `kvdata.open`),
beside the CLI that parses and prints for it; no torch.
"""
