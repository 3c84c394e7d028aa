"""`kvdata import parquet|hf`: Parquet files written by pyarrow and datasets saved by Hugging Face
`datasets`, imported and compared record for record; bad input fails with one clear line and
leaves the dataset as it was. Also Store.set_extra, where the hf importer keeps split and features.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvdata
from kvdata.errors import InvalidValueError

# ---------------------------------------------------------------- Store.set_extra


def test_set_extra_is_committed_kept_by_later_commits_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "ds"
    with kvdata.open(path, "a") as s:
        s.put("a", {"x": 1})
        s.set_extra("import", {"kind": "hf", "split": "train"})
        s.commit()
    with kvdata.open(path, "a") as s:
        assert s.manifest.extra == {"import": {"kind": "hf", "split": "train"}}
        s.put("b", {"x": 2})
        s.commit()  # a later writer that does not set it keeps it
        for name, value in (("count", 1), ("", 1), ("x", float("nan")), ("y", object()), ("z", [[[[[[[[[[[[[[[[
                [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])):
            with pytest.raises(InvalidValueError, match="manifest key"):
                s.set_extra(name, value)
        s.set_extra("import", {"kind": "parquet"})
    assert json.loads((path / "manifest.json").read_text())["import"] == {"kind": "parquet"}
    with pytest.raises(RuntimeError), kvdata.open(path, "a") as s:  # an aborted writer drops it
        s.set_extra("import", {"kind": "other"})
        raise RuntimeError
    with kvdata.open(path) as r:
        assert r.manifest.extra == {"import": {"kind": "parquet"}} and len(r) == 2
