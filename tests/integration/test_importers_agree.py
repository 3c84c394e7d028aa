"""Every importer names fields and records classes the same way (issue 27 item 5).

The same 12 small PNGs in 3 classes are exported as an ImageFolder tree, a Caffe list file, a
WebDataset tar (webdataset's own TarWriter), a Parquet file (pyarrow) and a TFRecord file, and
each is imported with the defaults and with --decode rgb. Every dataset then gives
batch["image"] and batch["label"] through Store.get_batch (and kvdata.Loader when decoded),
with the same contents whatever the importer, and `kvdata info --json`'s classes equal the
import summary's.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata.reader.open import open_dataset

from helpers.wire import example_bytes, tfrecord_frame

CLASSES = 3
N = 12


def _png(i: int) -> tuple[bytes, np.ndarray]:
    from PIL import Image

    pixels = np.random.default_rng(i).integers(0, 256, (5, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue(), pixels


SAMPLES = [(f"s{i:03d}", i % CLASSES, *_png(i)) for i in range(N)]  # (id, label, png, pixels)


def _folder(root: Path) -> tuple[list, dict]:
    for sid, label, png, _ in SAMPLES:
        (root / "tree" / f"c{label}").mkdir(parents=True, exist_ok=True)
        (root / "tree" / f"c{label}" / f"{sid}.png").write_bytes(png)
    return ["folder", root / "tree"], {sid: f"c{lb}/{sid}.png" for sid, lb, _, _ in SAMPLES}


def _listfile(root: Path) -> tuple[list, dict]:
    _folder(root)
    lines = [f"c{lb}/{sid}.png {lb}" for sid, lb, _, _ in SAMPLES]
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return ["listfile", root / "list.txt", "--root", root / "tree"], {sid: f"c{lb}/{sid}.png"
                                                                      for sid, lb, _, _ in SAMPLES}


def _wds(root: Path) -> tuple[list, dict]:
    webdataset = pytest.importorskip("webdataset")
    with webdataset.TarWriter(str(root / "shard-0000.tar")) as sink:
        for sid, label, png, _ in SAMPLES:
            sink.write({"__key__": sid, "png": png, "cls": label, "txt": f"caption {sid}"})
    return ["wds", root / "shard-0000.tar"], {sid: sid for sid, *_ in SAMPLES}


def _parquet(root: Path) -> tuple[list, dict]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": [s[0] for s in SAMPLES], "img": [s[2] for s in SAMPLES],
                      "label": pa.array([s[1] for s in SAMPLES], pa.int64())})
    pq.write_table(table, root / "data.parquet")
    return ["parquet", root / "data.parquet", "--key", "id"], {sid: sid for sid, *_ in SAMPLES}


def _tfrecord(root: Path) -> tuple[list, dict]:
    crc = pytest.importorskip("google_crc32c").value
    frames = b"".join(tfrecord_frame(example_bytes({"image/encoded": ("bytes", [png]), "image/class/label":
                                                    ("int", [label]), "id": ("bytes", [sid.encode()])}), crc)
                      for sid, label, png, _ in SAMPLES)
    (root / "data.tfrecord").write_bytes(frames)
    return ["tfrecord", root / "data.tfrecord", "--key", "id"], {sid: sid for sid, *_ in SAMPLES}


SOURCES = {"folder": _folder, "listfile": _listfile, "wds": _wds, "parquet": _parquet, "tfrecord": _tfrecord}


@pytest.mark.parametrize("decode", ["none", "rgb"])
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_importer_gives_image_and_label(tmp_path, cli, kind, decode):
    pytest.importorskip("PIL")
    args, key_of = SOURCES[kind](tmp_path)
    ds = tmp_path / "out.kv"
    summary = json.loads(cli.ok("import", *args, ds, "--decode", decode, "--json").out)
    info = json.loads(cli.ok("info", ds, "--json").out)
    assert summary["imported"] == N
    assert summary["classes"] == info["classes"] == CLASSES, (summary, info)
    assert set(info["fields"]) >= {"image", "label"}, info["fields"]
    assert "id" not in info["fields"]  # the key column/feature is the key, not also a field
    with open_dataset(ds) as store:
        idx = [store.find(key_of[sid]) for sid, *_ in SAMPLES]
        batch = store.get_batch(idx, fields=["image", "label"])
        labels = np.asarray(batch["label"]).tolist()
        assert labels == [lb for _, lb, _, _ in SAMPLES]
        assert store.labels[idx].tolist() == labels  # the index label too
        if decode == "none":
            assert [bytes(b) for b in batch["image"]] == [png for _, _, png, _ in SAMPLES]
        else:
            assert np.array_equal(batch["image"], np.stack([px for *_, px in SAMPLES]))
    if decode == "rgb":
        pytest.importorskip("torch")
        seen = []
        for b in kvdata.Loader(ds, batch_size=5, to="numpy", copy=True, fields=["image", "label"]):
            seen += [(int(lb), im.tobytes()) for im, lb in zip(b["image"], b["label"])]
        assert sorted(seen) == sorted((lb, px.tobytes()) for _, lb, _, px in SAMPLES)


def test_field_maps_a_source_name(tmp_path, cli):
    """--field SRC=DST renames (wds: keep `png` as it was), SRC=- leaves a field out."""
    args, _ = _wds(tmp_path)
    ds = tmp_path / "out.kv"
    cli.ok("import", *args, ds, "--field", "png=png", "--field", "txt=-", "--json")
    info = json.loads(cli.ok("info", ds, "--json").out)
    assert set(info["fields"]) == {"png", "label"}


def test_parquet_field_collision_is_refused(tmp_path, cli):
    args, _ = _parquet(tmp_path)
    r = cli.run("import", *args, tmp_path / "out.kv", "--field", "img=label")
    assert r.rc == 1 and "label" in r.err and not (tmp_path / "out.kv" / "manifest.json").exists()
