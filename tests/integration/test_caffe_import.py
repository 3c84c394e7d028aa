"""Importing Caffe LMDBs written exactly as convert_imageset writes them.

The source LMDBs are built here byte for byte the way Caffe's C++ does: an LMDB
environment directory, keys "%08d_<filename>", values the serialized `Datum`
with its fields in field-number order (raw: CVMatToDatum sets channels, height,
width, data and encoded=false, then the label is set; encoded: ReadFileToDatum
sets data, label and encoded=true). The Datum bytes come from a small protobuf
wire *encoder* (tests/helpers/wire.py), independent of kvdata's descriptor, so a wrong
field number or type in kvdata/caffe.py fails here. Raw images are stored CHW
as Caffe does; their channel order (BGR from OpenCV in Caffe) is kept as stored.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from PIL import Image

import kvdata
from kvdata.errors import ConfigError, InvalidKeyError, InvalidValueError, KVDataError
from kvdata.importers.caffe import datum_class, import_caffe
from kvdata.reader.open import verify

from helpers.wire import datum_bytes, write_caffe_lmdb

KVDATA = str(Path(sys.executable).parent / "kvdata")
H, W = 12, 10


# ---------------------------------------------------------------- a Caffe Datum, as protobuf wire bytes

def raw_datum(hwc: np.ndarray, label: int) -> bytes:
    """CVMatToDatum + set_label: uint8 pixels in CHW order."""
    h, w, c = hwc.shape
    chw = np.ascontiguousarray(hwc.transpose(2, 0, 1))
    return datum_bytes(channels=c, height=h, width=w, data=chw.tobytes(), label=label, encoded=False)


def encoded_datum(file_bytes: bytes, label: int) -> bytes:
    """ReadFileToDatum: the image file's bytes, the label, encoded=true."""
    return datum_bytes(data=file_bytes, label=label, encoded=True)


def pixels(i: int, c: int = 3, h: int = H, w: int = W) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)


def smooth(i: int, h: int = 32, w: int = 32) -> np.ndarray:
    """A gradient image (no sharp edges) that JPEG keeps close to the original."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 6 + 10 * i, y * 6, np.full((h, w), 40 * i + 30)], -1).astype(np.uint8)


def encode(hwc: np.ndarray, format: str, mode: str | None = None) -> bytes:
    im = Image.fromarray(hwc[:, :, 0] if hwc.shape[2] == 1 else hwc)
    if mode is not None:
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=format, **({"quality": 95} if format == "JPEG" else {}))
    return buf.getvalue()


def contents(ds: Path) -> tuple[list[str], list[dict[str, Any]], list[int]]:
    with kvdata.open(ds) as store:
        keys = list(store.keys())
        return keys, [store.get(k, copy=True) for k in keys], store.labels.tolist()


def samples(ds: Path) -> int:
    if not ds.exists():
        return 0
    with kvdata.open(ds) as store:
        return len(store)


# ---------------------------------------------------------------- the Datum schema

def test_datum_class_matches_caffe_proto() -> None:
    Datum = datum_class()
    d = Datum.DESCRIPTOR
    assert d.full_name == "caffe.Datum" and d.file.package == "caffe"
    assert [(f.name, f.number) for f in d.fields] == [
        ("channels", 1), ("height", 2), ("width", 3), ("data", 4), ("label", 5), ("float_data", 6), ("encoded", 7)]
    assert Datum().encoded is False and not Datum().HasField("encoded")
    assert datum_class() is Datum
    # byte-identical to Caffe's C++ serialization, both ways
    raw = raw_datum(pixels(0, c=3, h=2, w=3), label=-3)
    assert Datum(channels=3, height=2, width=3, data=Datum.FromString(raw).data, label=-3,
                 encoded=False).SerializeToString() == raw
    flt = datum_bytes(channels=1, height=1, width=2, label=1, float_data=[0.5, -2.0])
    parsed = Datum.FromString(flt)
    assert list(parsed.float_data) == [0.5, -2.0] and parsed.label == 1 and not parsed.HasField("encoded")
    assert parsed.SerializeToString() == flt


def test_import_kvdata_does_not_load_protobuf() -> None:
    code = ("import sys, kvdata, kvdata.cli, kvdata.cli.imports\n"
            "assert 'google.protobuf' not in sys.modules, 'protobuf imported'\n"
            "import kvdata.importers.caffe\n"
            "assert 'google.protobuf' not in sys.modules, 'protobuf imported by kvdata.importers.caffe'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_protobuf_says_how_to_install(tmp_path: Path) -> None:
    code = ("import sys\n"
            "sys.modules['google.protobuf'] = None  # as if protobuf were not installed\n"
            "from kvdata.importers.caffe import import_caffe\n"
            "from kvdata.errors import KVDataError\n"
            "try:\n"
            f"    import_caffe({str(tmp_path)!r}, {str(tmp_path / 'ds')!r}, progress=False)\n"
            "except KVDataError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install 'kvdata[caffe]'" in out
    assert not (tmp_path / "ds").exists()


# ---------------------------------------------------------------- raw, float and encoded records

def test_raw_records_keep_keys_order_pixels_and_labels(tmp_path: Path) -> None:
    images = [pixels(i) for i in range(4)] + [pixels(9, c=1, h=7, w=5)]
    labels = [3, 0, 2, 1, 7]
    # filenames out of alphabetical order: the "%08d_" prefix (list order) decides the order
    names = ["zebra/z1.jpg", "ant/a1.jpg", "my dir/b c.png", "dog/d.jpg", "gray/g.png"]
    keys = write_caffe_lmdb(tmp_path / "train_lmdb",
                            [(n, raw_datum(im, lb)) for n, im, lb in zip(names, images, labels)])
    summary = import_caffe(tmp_path / "train_lmdb", tmp_path / "ds", progress=False)
    # Datums carry no class names: the classes are numbered "0".."max label" (docs/CLI.md, "Field names and classes")
    assert summary["imported"] == 5 and summary["skipped"] == 0 and summary["classes"] == 8
    with kvdata.open(tmp_path / "ds") as store:
        assert list(store.classes) == [str(i) for i in range(8)]
    assert summary["dataset"] == str(tmp_path / "ds") and summary["seconds"] >= 0

    got_keys, values, got_labels = contents(tmp_path / "ds")
    assert got_keys == keys and keys[0] == "00000000_zebra/z1.jpg" and keys[4] == "00000004_gray/g.png"
    assert got_labels == labels
    for value, im, lb in zip(values, images, labels):
        assert set(value) == {"image", "label"} and value["label"] == lb
        assert value["image"].dtype == np.uint8 and value["image"].shape == im.shape  # HWC, gray is HxWx1
        np.testing.assert_array_equal(value["image"], im)  # channel order as stored
    assert values[4]["image"].shape == (7, 5, 1)
    report = verify(tmp_path / "ds", progress=False)
    assert report["ok"] and report["samples"] == 5


def test_float_data_records(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((4, 3, 2)).astype(np.float32), rng.standard_normal((2, 2, 1)).astype(np.float32)]
    records = []
    for i, hwc in enumerate(arrays):
        h, w, c = hwc.shape
        chw = hwc.transpose(2, 0, 1).reshape(-1).tolist()
        records.append((f"f{i}", datum_bytes(channels=c, height=h, width=w, label=i, float_data=chw)))
    write_caffe_lmdb(tmp_path / "src", records)
    import_caffe(tmp_path / "src", tmp_path / "ds", progress=False)
    _, values, labels = contents(tmp_path / "ds")
    assert labels == [0, 1]
    for value, hwc in zip(values, arrays):
        assert value["image"].dtype == np.float32
        np.testing.assert_array_equal(value["image"], hwc)


def test_encoded_png_records_are_decoded_or_kept(tmp_path: Path) -> None:
    rgb, gray, pal = pixels(1), pixels(2, c=1), smooth(3, 8, 8)
    deep = np.arange(6 * 4, dtype=np.uint16).reshape(6, 4) * 2000  # a 16-bit grayscale PNG
    buf = io.BytesIO()
    Image.fromarray(deep).save(buf, format="PNG")
    files = [encode(rgb, "PNG"), encode(gray, "PNG"), encode(pal, "PNG", mode="P"), buf.getvalue()]
    assert Image.open(io.BytesIO(files[2])).mode == "P"
    keys = write_caffe_lmdb(tmp_path / "src", [(f"img{i}.png", encoded_datum(f, 10 + i)) for i, f in enumerate(files)])

    import_caffe(tmp_path / "src", tmp_path / "decoded", progress=False)
    got_keys, values, labels = contents(tmp_path / "decoded")
    assert got_keys == keys and labels == [10, 11, 12, 13]
    np.testing.assert_array_equal(values[3]["image"], (deep >> 8).astype(np.uint8)[:, :, None])  # as OpenCV would
    np.testing.assert_array_equal(values[0]["image"], rgb)
    assert values[1]["image"].shape == (H, W, 1)
    np.testing.assert_array_equal(values[1]["image"], gray)
    with Image.open(io.BytesIO(files[2])) as im:
        np.testing.assert_array_equal(values[2]["image"], np.asarray(im.convert("RGB")))
    assert values[2]["image"].shape == (8, 8, 3)
    assert all(v["image"].dtype == np.uint8 for v in values)

    summary = import_caffe(tmp_path / "src", tmp_path / "kept", keep_encoded=True, progress=False)
    assert summary["imported"] == 4
    got_keys, values, labels = contents(tmp_path / "kept")
    assert got_keys == keys and labels == [10, 11, 12, 13]
    for value, f, lb in zip(values, files, labels):
        assert set(value) == {"image", "label"} and value["label"] == lb  # the file bytes, as every importer names them
        assert bytes(value["image"]) == f
    assert verify(tmp_path / "kept", progress=False)["ok"]


def test_encoded_jpeg_records(tmp_path: Path) -> None:
    images = [smooth(i) for i in range(3)]
    files = [encode(im, "JPEG") for im in images]
    write_caffe_lmdb(tmp_path / "src", [(f"n{i}/x.JPEG", encoded_datum(f, i)) for i, f in enumerate(files)])
    import_caffe(tmp_path / "src", tmp_path / "ds", progress=False)
    _, values, labels = contents(tmp_path / "ds")
    assert labels == [0, 1, 2]
    for value, im, f in zip(values, images, files):
        assert value["image"].shape == (32, 32, 3) and value["image"].dtype == np.uint8
        assert np.abs(value["image"].astype(int) - im.astype(int)).mean() < 3
        with Image.open(io.BytesIO(f)) as decoded:
            np.testing.assert_array_equal(value["image"], np.asarray(decoded))


# ---------------------------------------------------------------- failures commit nothing

def test_corrupt_record_names_the_key_and_commits_nothing(tmp_path: Path) -> None:
    good = raw_datum(pixels(0), 1)
    garbage = np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes()
    keys = write_caffe_lmdb(tmp_path / "src", [("a.jpg", good), ("b.jpg", good), ("broken.jpg", garbage),
                                               ("c.jpg", good)])
    with pytest.raises(InvalidValueError, match=keys[2]) as info:
        import_caffe(tmp_path / "src", tmp_path / "ds", progress=False)
    assert "\n" not in str(info.value)
    assert samples(tmp_path / "ds") == 0
    # an existing dataset stays at its generation (an overwrite: its deletes are discarded too)
    with kvdata.open(tmp_path / "old", "a") as store:
        store.put("existing", b"kept")
    with pytest.raises(InvalidValueError, match=keys[2]):
        import_caffe(tmp_path / "src", tmp_path / "old", progress=False, existing="overwrite")
    with kvdata.open(tmp_path / "old") as store:
        assert list(store.keys()) == ["existing"]


@pytest.mark.parametrize("value, message", [
    (datum_bytes(channels=3, height=2, width=2, data=b"\x00" * 11, label=0, encoded=False), "holds 11 bytes"),
    (datum_bytes(data=b"\x89PNG\r\n\x1a\n not a png", label=0, encoded=True), "Pillow cannot decode"),
    (datum_bytes(channels=1, height=1, width=1, label=0), "neither data nor float_data"),
])
def test_damaged_datum_is_named(tmp_path: Path, value: bytes, message: str) -> None:
    keys = write_caffe_lmdb(tmp_path / "src", [("ok.png", raw_datum(pixels(0), 0)), ("bad.png", value)])
    with pytest.raises(InvalidValueError, match=message) as info:
        import_caffe(tmp_path / "src", tmp_path / "ds", progress=False)
    assert keys[1] in str(info.value)
    assert samples(tmp_path / "ds") == 0


def test_source_that_is_not_an_lmdb_fails_before_writing(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text("hello")
    (tmp_path / "empty_dir").mkdir()
    for src in (tmp_path / "missing", tmp_path / "text.txt", tmp_path / "empty_dir"):
        with pytest.raises(ConfigError, match=str(src)):
            import_caffe(src, tmp_path / "ds", progress=False)
    write_caffe_lmdb(tmp_path / "empty_lmdb", [])
    with pytest.raises(ConfigError, match="no data.mdb"):
        import_caffe(tmp_path / "empty_dir", tmp_path / "ds", progress=False)
    with pytest.raises(ConfigError, match="no records"):
        import_caffe(tmp_path / "empty_lmdb", tmp_path / "ds", progress=False)
    write_caffe_lmdb(tmp_path / "other", [("x", b"\xff" * 40)])  # an LMDB, but not of Datums
    with pytest.raises(InvalidValueError, match="not a Caffe Datum"):
        import_caffe(tmp_path / "other", tmp_path / "ds", progress=False)
    with pytest.raises(ConfigError, match="shard_size"):
        import_caffe(tmp_path / "other", tmp_path / "ds", shard_size="lots", progress=False)
    assert not (tmp_path / "ds").exists()
    assert not (tmp_path / "empty_dir" / "data.mdb").exists()  # read-only: nothing created


def test_data_file_path_and_non_utf8_key(tmp_path: Path) -> None:
    write_caffe_lmdb(tmp_path / "src", [("a.png", raw_datum(pixels(0), 4))])
    summary = import_caffe(tmp_path / "src" / "data.mdb", tmp_path / "ds", progress=False)  # subdir=False
    assert summary["imported"] == 1 and contents(tmp_path / "ds")[0] == ["00000000_a.png"]
    env = lmdb.open(str(tmp_path / "latin1"), map_size=1 << 22)
    with env.begin(write=True) as txn:
        txn.put(b"00000000_caf\xe9.png", raw_datum(pixels(0), 0))
    env.close()
    with pytest.raises(InvalidKeyError, match=r"caf\\xe9"):
        import_caffe(tmp_path / "latin1", tmp_path / "ds2", progress=False)
    assert not (tmp_path / "ds2").exists()


# ---------------------------------------------------------------- the console script

def run_cli(*args: str | os.PathLike[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([KVDATA, *map(os.fspath, args)], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_cli_import_caffe(tmp_path: Path) -> None:
    images = [pixels(i) for i in range(3)]
    keys = write_caffe_lmdb(tmp_path / "src", [(f"{i}.jpg", raw_datum(im, i)) for i, im in enumerate(images)]
                            + [("p.png", encoded_datum(encode(pixels(7), "PNG"), 5))])
    p = run_cli("import", "caffe", "src", "ds", "--json", "--shard-size", "1MB", "--no-compress", cwd=tmp_path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    summary = json.loads(p.stdout)
    assert summary["imported"] == 4 and summary["classes"] == 6 and summary["dataset"] == "ds"  # "0".."5"
    assert summary["writers"] == 1  # every importer's --json has the folder importer's keys (docs/CLI.md)
    got_keys, values, labels = contents(tmp_path / "ds")
    assert got_keys == keys and labels == [0, 1, 2, 5]
    np.testing.assert_array_equal(values[3]["image"], pixels(7))
    p = run_cli("verify", "ds", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("ok: 4 records"), p.stderr

    p = run_cli("import", "caffe", "src", "kept", "--keep-encoded", cwd=tmp_path)
    assert p.returncode == 0 and "imported 4 images into kept" in p.stdout, p.stderr
    assert contents(tmp_path / "kept")[1][3]["image"] == encode(pixels(7), "PNG")

    write_caffe_lmdb(tmp_path / "bad", [("ok.jpg", raw_datum(pixels(0), 0)), ("x.jpg", b"\x0b\x0c garbage")])
    p = run_cli("import", "caffe", "bad", "ds3", cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdata: error:") and "00000001_x.jpg" in lines[0], p.stderr
    assert samples(tmp_path / "ds3") == 0


def test_library_error_is_a_kvdata_error(tmp_path: Path) -> None:
    with pytest.raises(KVDataError):
        import_caffe(tmp_path / "nope", tmp_path / "ds", progress=False)
