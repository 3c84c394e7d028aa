"""`kvdata import wds` and `kvdata import tfrecord`: real files round-trip record for record;
hostile tars and damaged TFRecords are refused (or skipped with --skip-bad) by name, with
nothing written.

WebDataset tars are written by webdataset's own TarWriter; the hostile ones by tarfile.
TFRecords are framed here with the format's real CRC-32C (google-crc32c, checked against
the published check value) and Examples are encoded by a small protobuf wire writer
(tests/helpers/wire.py), so neither depends on the importer's own code.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

import kvdata
from kvdata.errors import InvalidValueError
from kvdata.importers.tfrecord import import_tfrecord
from kvdata.importers.wds import import_wds

from helpers.wire import example_bytes, tfrecord_frame

PIL_Image = pytest.importorskip("PIL.Image", reason="the image round trips need Pillow (kvdata[images])")


def _png(seed: int, shape: tuple[int, ...] = (6, 7, 3)) -> tuple[bytes, np.ndarray]:
    pixels = np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)
    buf = io.BytesIO()
    PIL_Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue(), pixels


def _refused(run, *args, names, **kw) -> None:
    """The importer called in-process (the CLI's error path is tested elsewhere) refuses with
    one line naming every string in `names`; the dataset is not created."""
    with pytest.raises(InvalidValueError) as info:
        run(*args, **kw)
    message = str(info.value)
    assert "\n" not in message
    for n in names:
        assert n in message, f"{n!r} not named in: {message}"
    assert not Path(args[1]).exists()


def _read_all(path: Path) -> dict[str, dict]:
    with kvdata.open(path) as store:
        return {store.key_at(i): store.get_one(i, copy=True) for i in range(len(store))}


# ---------------------------------------------------------------- WebDataset

@pytest.fixture
def wds_shards(tmp_path):
    """Two shards written by webdataset's TarWriter: png + cls + json + txt + npy + bin per key
    (stored as the fields image + label + json + txt + npy + bin: docs/CLI.md, "Field names")."""
    webdataset = pytest.importorskip("webdataset", reason="webdataset is not installed (kvdata[test])")
    src = tmp_path / "shards"
    src.mkdir()
    expected = {}
    for s in range(2):
        with webdataset.TarWriter(str(src / f"shard-{s:04d}.tar")) as sink:
            for i in range(6):
                k = f"sample{s * 6 + i:05d}"
                png, pixels = _png(s * 6 + i)
                arr = np.arange(i + 1, dtype=np.float32) * s
                npy = io.BytesIO()
                np.save(npy, arr)
                rec = {"__key__": k, "png": png, "cls": (s * 6 + i) % 4, "json": {"i": i, "s": s},
                       "txt": f"caption {k} é", "npy": npy.getvalue(), "bin": bytes([i]) * 9}
                sink.write(rec)
                expected[k] = dict(rec, pixels=pixels, arr=arr)
    return src, expected


def test_wds_round_trips_record_for_record(tmp_path, wds_shards, cli):
    src, expected = wds_shards
    out = cli.ok("import", "wds", src, tmp_path / "raw", "--json").json()
    assert out["imported"] == 12 and out["skipped"] == 0 and out["bad"] == [] and out["classes"] == 4
    assert out["writers"] == 1  # the folder importer's keys too (docs/CLI.md)
    got = _read_all(tmp_path / "raw")
    assert list(got) == sorted(expected)
    for k, e in expected.items():
        r = got[k]
        assert set(r) == {"image", "label", "json", "txt", "npy", "bin"}
        assert bytes(r["image"]) == e["png"] and r["label"] == e["cls"] and json.loads(r["json"]) == e["json"]
        assert r["txt"] == e["txt"] and bytes(r["bin"]) == e["bin"]
        np.testing.assert_array_equal(r["npy"], e["arr"])
        assert r["npy"].dtype == np.float32
    with kvdata.open(tmp_path / "raw") as store:
        assert store.labels.tolist() == [expected[k]["cls"] for k in sorted(expected)]

    # decoded, with 2 workers: pixels equal the source's, and the dataset equals a 1-worker import
    import_wds(sorted(src.iterdir()), tmp_path / "rgb1", decode="rgb", workers=1)
    cli.ok("import", "wds", *sorted(src.iterdir()), tmp_path / "rgb2", "--decode", "rgb", "--workers", "2")
    one, two = _read_all(tmp_path / "rgb1"), _read_all(tmp_path / "rgb2")
    assert list(one) == list(two) == sorted(expected)
    for k, e in expected.items():
        np.testing.assert_array_equal(one[k]["image"], e["pixels"])
        np.testing.assert_array_equal(two[k]["image"], e["pixels"])


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _nul_name() -> tuple[tarfile.TarInfo, bytes]:
    info, data = _reg("b.txt", b"nul")
    info.pax_headers = {"path": "b\x00.txt"}  # a PAX path can carry a NUL a ustar name cannot
    return info, data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


@pytest.mark.parametrize("hostile, named", [
    (_link("b.txt", "/etc/passwd"), "symbolic link"),
    (_link("b.txt", "a.txt", tarfile.LNKTYPE), "hard link"),
    (_reg("../b.txt", b"escape"), "'..'"),
    (_reg("/abs/b.txt", b"escape"), "absolute"),
    (_nul_name(), "NUL"),
])
def test_hostile_tar_members_are_refused_or_skipped_by_name(tmp_path, cli, hostile, named):
    tar = _tar(tmp_path / "bad.tar", [_reg("a.txt", b"fine"), hostile, _reg("c.txt", b"also fine")])
    if named == "symbolic link":  # through the CLI once: exit code, one line, --json, the skipped line
        line = cli.fail("import", "wds", tar, tmp_path / "ds", names=[str(tar), named, "--skip-bad"])
        assert "nothing was imported" in line
        assert not (tmp_path / "ds").exists()
        r = cli.run("import", "wds", tar, tmp_path / "ds", "--skip-bad", "--json")
        assert r.rc == 0, str(r)
        out = r.json()
        assert "skipped" in r.err and named in r.err
    else:
        _refused(import_wds, [tar], tmp_path / "ds", names=[str(tar), named, "--skip-bad"])
        out = import_wds([tar], tmp_path / "ds", skip_bad=True)
    assert out["imported"] == 2 and len(out["bad"]) == 1 and named in out["bad"][0]["error"]
    assert {k: v["txt"] for k, v in _read_all(tmp_path / "ds").items()} == {"a": "fine", "c": "also fine"}


def test_a_huge_declared_size_and_a_damaged_header_are_refused(tmp_path, cli):
    good = _tar(tmp_path / "good.tar", [_reg(f"k{i}.txt", b"x" * 700) for i in range(3)])
    raw = bytearray(good.read_bytes())
    # member k1's header (after k0's header and two data blocks): declare 8 GiB (the largest octal size
    # field), checksum fixed so tarfile believes it
    huge_size = 8**11 - 1
    forged = bytearray(raw)
    start = 512 * 3
    hdr = forged[start:start + 512]
    assert hdr[:3] == b"k1."
    hdr[124:136] = b"%011o\x00" % huge_size
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\x00 " % sum(hdr)
    forged[start:start + 512] = hdr
    huge = tmp_path / "huge.tar"
    huge.write_bytes(bytes(forged))
    cli.fail("import", "wds", huge, tmp_path / "ds", names=[str(huge), "k1.txt", str(huge_size), "truncated"])
    _refused(import_wds, [huge], tmp_path / "ds", skip_bad=True, names=[str(huge), "k1.txt"])
    assert not (tmp_path / "ds").exists()
    # a member of an unknown type whose data tarfile skips, with the same forged size
    hdr[156:157] = b"Z"
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\x00 " % sum(hdr)
    forged[start:start + 512] = hdr
    huge.write_bytes(bytes(forged))
    _refused(import_wds, [huge], tmp_path / "ds", skip_bad=True, names=[str(huge), "k1.txt", "truncated"])
    # a size over the limit is one bad record: refused, or skipped
    _refused(import_wds, [good], tmp_path / "ds", max_member_size=500, names=["k0.txt", "700 bytes"])
    assert not (tmp_path / "ds").exists()
    # a damaged (not zero) header after the first member: tarfile would stop quietly; the importer names it
    damaged = bytearray(raw)
    damaged[start + 148:start + 156] = b"0000000\x00"  # wrong checksum
    bad = tmp_path / "damaged.tar"
    bad.write_bytes(bytes(damaged))
    cli.fail("import", "wds", bad, tmp_path / "ds", names=[str(bad), "after member 'k0.txt'", "damaged"])
    _refused(import_wds, [bad], tmp_path / "ds", skip_bad=True, names=[str(bad)])
    assert not (tmp_path / "ds").exists()
    notatar = tmp_path / "x.tar"
    notatar.write_bytes(b"hello" * 300)
    _refused(import_wds, [notatar], tmp_path / "ds", names=[str(notatar), "not an uncompressed tar"])


def test_an_undecodable_image_fails_the_import_or_is_skipped(tmp_path, cli):
    png, _ = _png(1)
    tar = _tar(tmp_path / "s.tar", [_reg("a.png", png), _reg("a.cls", b"1"), _reg("b.png", b"\x89PNG\r\n\x1a\nbroken"),
                                    _reg("b.cls", b"2"), _reg("c.cls", b"three")])
    existing = tmp_path / "ds"  # (appended to: its records have the fields the tar's will have)
    kvdata.from_iterable(existing, [{"k": "old", "image": np.zeros((6, 7, 1), np.uint8), "label": 0}], key="k")
    with pytest.raises(InvalidValueError, match=r"s\.tar: member 'b\.png': field 'png' of key 'b': Pillow cannot decode"):
        import_wds([tar], existing, decode="rgb", existing="append")
    assert list(_read_all(existing)) == ["old"]  # all-or-nothing: the failed import left it as it was
    r = cli.run("import", "wds", tar, existing, "--decode", "gray", "--skip-bad", "--append", "--json")
    assert r.rc == 0, str(r)
    assert sorted(b["key"] for b in r.json()["bad"]) == ["b", "c"]
    got = _read_all(existing)
    assert list(got) == ["old", "a"] and got["a"]["image"].shape == (6, 7, 1) and got["a"]["label"] == 1


def test_duplicate_keys_across_shards_are_refused(tmp_path, cli):
    a = _tar(tmp_path / "a.tar", [_reg("k.txt", b"1")])
    b = _tar(tmp_path / "b.tar", [_reg("k.txt", b"2")])
    _refused(import_wds, [a, b], tmp_path / "ds", names=["'k'", "appears twice", str(a)])
    assert not (tmp_path / "ds").exists()


# ---------------------------------------------------------------- TFRecord

def _crc32c(data: bytes) -> int:
    google_crc32c = pytest.importorskip("google_crc32c", reason="google-crc32c is not installed (kvdata[test])")
    return google_crc32c.value(data)


def _frame(data: bytes) -> bytes:
    return tfrecord_frame(data, _crc32c)


def test_crc32c_matches_the_published_check_value():
    from kvdata.importers.tfrecord import crc32c, crc32c_py

    assert crc32c_py(b"123456789") == 0xE3069283 == _crc32c(b"123456789")
    data = np.random.default_rng(0).bytes(4099)
    assert crc32c_py(data) == crc32c(data) == _crc32c(data)


@pytest.fixture
def tfrecords(tmp_path):
    src = tmp_path / "tfr"
    src.mkdir()
    expected = {}
    for f in range(2):
        frames = b""
        for i in range(7):
            n = f * 7 + i
            png, pixels = _png(100 + n)
            feats = {"image/encoded": ("bytes", [png]), "label": ("int", [n % 3]), "id": ("bytes", [f"ex-{n}".encode()]),
                     "bbox": ("float", [0.25, 0.5, 0.75 + n]), "shape": ("int", [6, 7, -3]), "score": ("float", [1.5]),
                     "tags": ("bytes", [b"a", b"bb"]), "empty": ("int", [])}
            frames += _frame(example_bytes(feats))
            expected[f"ex-{n}"] = (feats, pixels, f"part-{f}.tfrecord", i)
        (src / f"part-{f}.tfrecord").write_bytes(frames)
    return src, expected


def test_tfrecord_round_trips_record_for_record(tmp_path, tfrecords, cli):
    src, expected = tfrecords
    out = cli.ok("import", "tfrecord", src, tmp_path / "ds", "--key", "id", "--json").json()
    assert out["imported"] == 14 and out["bad"] == [] and out["classes"] == 3 and out["writers"] == 1
    got = _read_all(tmp_path / "ds")
    assert list(got) == list(expected)
    for k, (feats, _pixels, _file, _i) in expected.items():
        r = got[k]
        assert "image/encoded" not in r and "id" not in r  # the image is 'image'; the key feature is only the key
        assert bytes(r["image"]) == feats["image/encoded"][1][0]
        assert r["label"] == feats["label"][1][0] and r["score"] == 1.5
        np.testing.assert_array_equal(r["bbox"], np.array(feats["bbox"][1], dtype=np.float32))
        assert r["bbox"].dtype == np.float32
        np.testing.assert_array_equal(r["shape"], [6, 7, -3])
        assert r["shape"].dtype == np.int64 and r["empty"].shape == (0,)
        assert bytes(r["tags[0]"]) == b"a" and bytes(r["tags[1]"]) == b"bb"
    with kvdata.open(tmp_path / "ds") as store:
        assert store.labels.tolist() == [feats["label"][1][0] for feats, *_ in expected.values()]
    # generated keys, decoded images, 2 workers
    cli.ok("import", "tfrecord", *sorted(src.iterdir()), tmp_path / "rgb", "--decode", "rgb", "--workers", "2")
    got = _read_all(tmp_path / "rgb")
    assert list(got) == [f"{file}/{i:08d}" for _f, _p, file, i in expected.values()]
    for (_feats, pixels, file, i) in expected.values():
        np.testing.assert_array_equal(got[f"{file}/{i:08d}"]["image"], pixels)


def test_workers_with_decode_none_read_in_process(tmp_path, wds_shards, tfrecords):
    """Before: `--workers 2 --decode none` handed every record's bytes from a pool to the writer
    and ran at 0.60x (wds) / 0.67x (tfrecord) the in-process rate (bench/imports.py); a pool is
    now started only to decode, and the dataset is the in-process one."""
    from kvdata.importers.records import decode_workers

    assert decode_workers(2, "none") == 0 and decode_workers(2, "rgb") == 2 and decode_workers(3, "gray") == 3
    _same_with_0_and_2_workers(tmp_path, wds_shards, tfrecords, decode="none")


def _same_with_0_and_2_workers(tmp_path: Path, wds_shards, tfrecords, decode: str) -> None:
    """wds and tfrecord imports with no worker and with 2: record for record the same (arrays
    of the same dtype and values)."""
    for name, run, src in (("wds", import_wds, wds_shards[0]), ("tfrecord", import_tfrecord, tfrecords[0])):
        one = run([src], tmp_path / f"{name}-0", decode=decode, progress=False)
        two = run([src], tmp_path / f"{name}-2", decode=decode, workers=2, progress=False)
        assert one["imported"] == two["imported"] > 0
        a, b = _read_all(tmp_path / f"{name}-0"), _read_all(tmp_path / f"{name}-2")
        assert list(a) == list(b)
        for k in a:
            assert a[k].keys() == b[k].keys()
            for f in a[k]:
                x, y = a[k][f], b[k][f]
                if isinstance(x, np.ndarray):
                    assert x.dtype == y.dtype and np.array_equal(x, y), (name, k, f)
                else:
                    assert x == y, (name, k, f)


@pytest.mark.parametrize("region, first", [(None, 2), (256, 4096)], ids=["shared-ring", "pickled"])
def test_decoding_workers_hand_arrays_over_in_shared_memory(tmp_path, wds_shards, tfrecords, monkeypatch,
                                                            region, first):
    """With --decode, workers place decoded pixels (and the other arrays of a record: wds .npy)
    in a shared mapping instead of pickling them back. Batches of 2 tasks make the two regions
    turn over many times, so a region handed out again before the writer put its batch would
    show as wrong pixels; a region too small for any array sends them all pickled."""
    from kvdata.importers import records

    monkeypatch.setattr(records, "FIRST_BATCH", first)
    monkeypatch.setattr(records, "MAX_BATCH", first)
    if region is not None:
        monkeypatch.setattr(records, "REGION_BYTES", region)
    _same_with_0_and_2_workers(tmp_path, wds_shards, tfrecords, decode="rgb")
    decoded = _read_all(tmp_path / "wds-2")
    for k, e in wds_shards[1].items():
        assert decoded[k]["image"].dtype == np.uint8
        np.testing.assert_array_equal(decoded[k]["image"], e["pixels"])


def test_damaged_tfrecords_are_refused_naming_file_and_record(tmp_path, cli):
    frames = [_frame(example_bytes({"v": ("int", [i])})) for i in range(5)]
    data_bad = tmp_path / "data.tfrecord"
    broken = bytearray(frames[3])
    broken[-6] ^= 0xFF  # a byte of record 3's data
    data_bad.write_bytes(b"".join(frames[:3]) + bytes(broken) + frames[4])
    cli.fail("import", "tfrecord", data_bad, tmp_path / "ds", names=[str(data_bad), "record 3", "CRC"])
    assert not (tmp_path / "ds").exists()
    out = import_tfrecord([data_bad], tmp_path / "ds", skip_bad=True)
    assert out["imported"] == 4 and [b["where"] for b in out["bad"]] == [f"{data_bad}: record 3"]
    assert [v["v"] for v in _read_all(tmp_path / "ds").values()] == [0, 1, 2, 4]

    length_bad = tmp_path / "length.tfrecord"
    broken = bytearray(frames[2])
    broken[9] ^= 0x01  # the length's CRC
    length_bad.write_bytes(b"".join(frames[:2]) + bytes(broken))
    _refused(import_tfrecord, [length_bad], tmp_path / "ds2", names=[str(length_bad), "record 2", "length's CRC"])
    _refused(import_tfrecord, [length_bad], tmp_path / "ds2", skip_bad=True,
             names=[str(length_bad), "record 2", "length's CRC"])
    truncated = tmp_path / "short.tfrecord"
    truncated.write_bytes(b"".join(frames)[:-3])
    _refused(import_tfrecord, [truncated], tmp_path / "ds2", names=[str(truncated), "record 4", "truncated"])
    import gzip

    gz = tmp_path / "a.tfrecord.gz"
    gz.write_bytes(gzip.compress(b"".join(frames)))
    _refused(import_tfrecord, [gz], tmp_path / "ds2", names=[str(gz), "gzip", "gunzip it first"])
    assert not (tmp_path / "ds2").exists()

    _refused(import_tfrecord, [data_bad], tmp_path / "ds3", key_feature="nope", names=["no key feature 'nope'"])
    assert not (tmp_path / "ds3").exists()


def test_dot_slash_names_and_directories_group_as_webdataset_does(tmp_path):
    d = tarfile.TarInfo("./d")
    d.type = tarfile.DIRTYPE
    tar = _tar(tmp_path / "s.tar", [(d, None), _reg("./d/a.seg.txt", b"x"), _reg("./d/a.cls", b" 7\n"),
                                    _reg("./d/README", b"no extension")])
    out = import_wds([tar], tmp_path / "ds")
    assert out["imported"] == 1 and out["skipped"] == 2  # the directory and the member without an extension
    assert _read_all(tmp_path / "ds") == {"d/a": {"seg.txt": "x", "label": 7}}


def test_workers_name_a_damaged_tar_and_a_tar_replaced_after_the_scan(tmp_path, cli):
    from kvdata.importers.wds import load_group, scan_tar

    tars = [_tar(tmp_path / f"{s}.tar", [_reg(f"k{s}{i}.txt", b"x" * 700) for i in range(3)]) for s in range(3)]
    raw = bytearray(tars[1].read_bytes())
    raw[512 * 3 + 148:512 * 3 + 156] = b"0000000\x00"
    tars[1].write_bytes(bytes(raw))
    # --decode rgb: a pool scans the tars (with --decode none they are read in-process)
    cli.fail("import", "wds", *tars, tmp_path / "ds", "--workers", "2", "--decode", "rgb",
             names=[str(tars[1]), "after member 'k10.txt'"])
    assert not (tmp_path / "ds").exists()

    groups, bad, _ = scan_tar(str(tars[0]), 1 << 20)
    assert not bad and load_group(groups[0])[0].value == {"txt": "x" * 700}
    tars[0].rename(tmp_path / "moved.tar")
    tars[2].rename(tars[0])  # same name, another file: the scan's offsets must not be read from it
    (result,) = load_group(groups[0])
    assert result.reason.startswith("the file was replaced while importing")


def test_the_pure_python_crc_imports_the_same_records(tmp_path, monkeypatch):
    from kvdata.importers import tfrecord

    frames = b"".join(_frame(example_bytes({"v": ("int", [i]), "b": ("bytes", [bytes(range(i, i + 40))])}))
                      for i in range(6))
    (tmp_path / "a.tfrecord").write_bytes(frames)
    monkeypatch.setattr(tfrecord, "_crc_function", lambda: tfrecord.crc32c_py)
    import_tfrecord([tmp_path / "a.tfrecord"], tmp_path / "ds")
    got = _read_all(tmp_path / "ds")
    assert [(r["v"], bytes(r["b"])) for r in got.values()] == [(i, bytes(range(i, i + 40))) for i in range(6)]
    broken = bytearray(frames)
    broken[30] ^= 1  # inside record 0's data
    (tmp_path / "b.tfrecord").write_bytes(bytes(broken))
    _refused(import_tfrecord, [tmp_path / "b.tfrecord"], tmp_path / "ds2", names=["record 0", "data's CRC"])
