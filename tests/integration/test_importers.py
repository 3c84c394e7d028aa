"""Importing ImageFolder trees and Caffe list files with real (tiny) images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import kvdata
from kvdata import format as fmt
from kvdata.errors import ConfigError, InvalidValueError, KVDataError
from kvdata.importers.folder import import_folder, import_listfile

CLASSES = ["cat", "dog", "fish"]
W, H = 32, 24


def _pixels(c: int, i: int) -> np.ndarray:
    """A distinct, non-flat image per (class, index), so orders and resizes are visible."""
    rng = np.random.default_rng(100 * c + i)
    base = np.array([80 * c + 20, 40 * i + 10, 200 - 30 * c], dtype=np.int16)
    noise = rng.integers(-10, 10, size=(H, W, 3), dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """src/<class>/<file>: 3 classes x 5 images (PNG and JPEG), one unlabeled image, one non-image."""
    src = tmp_path_factory.mktemp("images")
    for c, name in enumerate(CLASSES):
        (src / name).mkdir()
        for i in range(5):
            ext = "png" if i % 2 == 0 else "JPG"  # upper case extensions count too
            Image.fromarray(_pixels(c, i)).save(src / name / f"img{i}.{ext}", format="PNG" if ext == "png" else "JPEG")
    Image.fromarray(_pixels(3, 0)).save(src / "loose.png")
    (src / "cat" / "README.txt").write_text("not an image")
    return src


def _keys(path: Path) -> list[str]:
    with kvdata.open(path) as store:
        return list(store.keys())


def _source(tree: Path, key: str) -> np.ndarray:
    with Image.open(tree / key) as im:
        return np.asarray(im.convert("RGB"))


def test_folder_bytes_round_trip_with_labels_and_classes(tree: Path, tmp_path: Path) -> None:
    summary = import_folder(tree, tmp_path / "ds", progress=False)
    assert summary["imported"] == 16 and summary["skipped"] == 1 and summary["classes"] == 3
    assert summary["dataset"] == str(tmp_path / "ds") and summary["seconds"] >= 0
    with kvdata.open(tmp_path / "ds") as store:
        assert store.classes == CLASSES
        assert len(store) == 16
        labels = store.labels
        for i, key in enumerate(store.keys()):
            rec = store[i]
            assert bytes(rec["image"]) == (tree / key).read_bytes()
            if key == "loose.png":
                assert "label" not in rec and labels[i] == fmt.NO_LABEL
            else:
                want = CLASSES.index(key.split("/")[0])
                assert rec["label"] == want and labels[i] == want


def test_decode_rgb_keeps_pixels(tree: Path, tmp_path: Path) -> None:
    import_folder(tree, tmp_path / "ds", decode="rgb", progress=False)
    with kvdata.open(tmp_path / "ds") as store:
        for key in store.keys():
            img = store.get(key)["image"]
            assert img.shape == (H, W, 3) and img.dtype == np.uint8
            src = _source(tree, key)
            if key.endswith(".png"):
                np.testing.assert_array_equal(img, src)
            else:
                assert np.abs(img.astype(int) - src.astype(int)).mean() < 3


def test_resize_and_gray(tree: Path, tmp_path: Path) -> None:
    import_folder(tree, tmp_path / "small", decode="rgb", resize=(16, 8), progress=False)
    import_folder(tree, tmp_path / "gray", decode="gray", progress=False)
    with kvdata.open(tmp_path / "small") as small, kvdata.open(tmp_path / "gray") as gray:
        assert all(small[i]["image"].shape == (8, 16, 3) for i in range(len(small)))
        img = gray.get("dog/img2.png")["image"]
        assert img.shape == (H, W, 1) and img.dtype == np.uint8
        with Image.open(tree / "dog/img2.png") as im:
            np.testing.assert_array_equal(img[:, :, 0], np.asarray(im.convert("L")))


def test_shuffle_is_deterministic(tree: Path, tmp_path: Path) -> None:
    import_folder(tree, tmp_path / "a", seed=7, progress=False)
    import_folder(tree, tmp_path / "b", seed=7, progress=False)
    import_folder(tree, tmp_path / "c", seed=8, progress=False)
    import_folder(tree, tmp_path / "d", shuffle=False, progress=False)
    a, b, c, d = (_keys(tmp_path / n) for n in "abcd")
    assert a == b
    assert a != c and sorted(a) == sorted(c)
    assert d == sorted(d) and a != d


def test_workers_give_the_same_dataset(tree: Path, tmp_path: Path) -> None:
    # a tiny shard size so the import spans several sealed shards
    import_folder(tree, tmp_path / "serial", decode="rgb", seed=3, shard_size="16KB", progress=False)
    import_folder(tree, tmp_path / "pool", decode="rgb", seed=3, workers=2, shard_size="16KB", progress=False)
    with kvdata.open(tmp_path / "serial") as s, kvdata.open(tmp_path / "pool") as p:
        assert list(s.keys()) == list(p.keys())
        np.testing.assert_array_equal(s.labels, p.labels)
        for i in range(len(s)):
            np.testing.assert_array_equal(s[i]["image"], p[i]["image"])


def test_listfile_with_spaces_in_paths(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    (root / "my dir").mkdir(parents=True)
    (root / "my dir" / "a b.png").write_bytes((tree / "cat/img0.png").read_bytes())
    (root / "c.jpg").write_bytes((tree / "dog/img1.JPG").read_bytes())
    listfile = tmp_path / "train.txt"
    listfile.write_text("my dir/a b.png 4\n\nc.jpg\t7\n")
    summary = import_listfile(listfile, tmp_path / "ds", root=root, decode="rgb", shuffle=False, progress=True)
    assert summary["imported"] == 2 and summary["classes"] == 8  # labels 4 and 7: classes "0".."7"
    assert "import" in capsys.readouterr().err  # the bar was shown and closed
    with kvdata.open(tmp_path / "ds") as store:
        assert list(store.keys()) == ["my dir/a b.png", "c.jpg"]
        assert store.labels.tolist() == [4, 7]
        assert store.classes == [str(i) for i in range(8)]  # numbered, as every importer
        np.testing.assert_array_equal(store.get("my dir/a b.png")["image"], _source(tree, "cat/img0.png"))


def test_malformed_listfile_line_writes_nothing(tree: Path, tmp_path: Path) -> None:
    listfile = tmp_path / "bad.txt"
    listfile.write_text("cat/img0.png 0\ncat/img1.JPG 1\ncat/img2.png two\n")
    with pytest.raises(InvalidValueError, match=r"bad\.txt:3: label 'two'"):
        import_listfile(listfile, tmp_path / "ds", root=tree, progress=False)
    assert not (tmp_path / "ds").exists()
    listfile.write_text("cat/img0.png 0\nno_label_here.png\n")
    with pytest.raises(InvalidValueError, match=r"bad\.txt:2: expected"):
        import_listfile(listfile, tmp_path / "ds", root=tree, progress=False)
    assert not (tmp_path / "ds").exists()


def test_listfile_missing_image_names_the_file(tree: Path, tmp_path: Path) -> None:
    listfile = tmp_path / "list.txt"
    listfile.write_text("cat/img0.png 0\ncat/nope.png 0\n")
    with pytest.raises(KVDataError, match=r"nope\.png does not exist"):
        import_listfile(listfile, tmp_path / "ds", root=tree, progress=False)
    assert not (tmp_path / "ds").exists()


def test_undecodable_image_commits_nothing(tree: Path, tmp_path: Path) -> None:
    bad = tmp_path / "src"
    (bad / "a").mkdir(parents=True)
    for i in range(4):
        (bad / "a" / f"{i}.png").write_bytes((tree / "cat/img0.png").read_bytes())
    (bad / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a") as store:
        store.put("existing", b"kept")
    for workers in (0, 2):  # (an overwrite: its deletes of the records there are discarded too)
        with pytest.raises(InvalidValueError, match=r"broken\.png: Pillow cannot decode"):
            import_folder(bad, ds, decode="rgb", shuffle=False, workers=workers, progress=False, existing="overwrite")
        with kvdata.open(ds) as store:
            assert list(store.keys()) == ["existing"] and store.classes == []


def test_bad_options_fail_before_writing(tree: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="resize"):
        import_folder(tree, tmp_path / "ds", resize=(16, 8), progress=False)
    with pytest.raises(ConfigError, match="decode"):
        import_folder(tree, tmp_path / "ds", decode="bgr", progress=False)
    with pytest.raises(ConfigError, match="no such directory"):
        import_folder(tmp_path / "missing", tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()
