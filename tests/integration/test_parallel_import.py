"""`kvdata import folder|listfile --workers N` into a new dataset: N writer processes each write a
part, merged without copying. Same records, keys, labels and order as one writer; all or nothing."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import kvdata
from kvdata.errors import InvalidValueError, KVDataError
from kvdata.format import NO_LABEL, names
from kvdata.importers import parts
from kvdata.importers.folder import import_folder, import_listfile
from kvdata.importers.parts import bounds
from kvdata.reader.open import verify

from helpers.cli import KVDATA, Cli

CLASSES = ["ant", "bee", "cow"]
PER_CLASS = 9


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """src/<class>/<file>: 3 classes x 9 small distinct images (PNG and JPEG) and one loose image."""
    src = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    for name in CLASSES:
        (src / name).mkdir()
        for i in range(PER_CLASS):
            px = rng.integers(0, 255, size=(12, 16, 3), dtype=np.uint8)
            Image.fromarray(px).save(src / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    Image.fromarray(rng.integers(0, 255, size=(12, 16, 3), dtype=np.uint8)).save(src / "loose.png")
    return src


def _records(path: Path) -> list[tuple[str, int, dict[str, np.ndarray]]]:
    with kvdata.open(path) as store:
        labels = store.labels.tolist()
        return [(k, labels[i], {f: np.asarray(v) for f, v in store[i].items()}) for i, k in enumerate(store.keys())]


def _assert_same(a: Path, b: Path) -> None:
    ra, rb = _records(a), _records(b)
    assert [r[0] for r in ra] == [r[0] for r in rb]  # keys and order
    assert [r[1] for r in ra] == [r[1] for r in rb]
    for (key, _, va), (_, _, vb) in zip(ra, rb):
        assert va.keys() == vb.keys(), key
        for f in va:
            np.testing.assert_array_equal(va[f], vb[f], err_msg=f"{key}: {f}")
    with kvdata.open(a) as sa, kvdata.open(b) as sb:
        assert sa.classes == sb.classes


def _no_leftovers(tmp_path: Path, shm_before: set[str]) -> None:
    assert not [p.name for p in tmp_path.iterdir() if ".parts-" in p.name]
    new_shm = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(("pym-", "psm_", "mp-"))}
    assert not new_shm, new_shm


def _shards_not_shared(ds: Path) -> None:
    """The merged shards are the parts' files moved: no other link to them remains."""
    shards = sorted((ds / names.SHARDS_DIR).iterdir())
    assert shards
    for f in shards:
        assert f.stat().st_nlink == 1, f


def test_bounds_are_contiguous_slices() -> None:
    assert bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert bounds(2, 4) == [(0, 1), (1, 2)]  # empty slices get no writer


@pytest.mark.parametrize("workers", [2, 3])
def test_folder_parts_equal_one_writer(tree: Path, tmp_path: Path, workers: int) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    one = import_folder(tree, tmp_path / "one", decode="rgb", seed=5, workers=1, shard_size="4KB", progress=False)
    many = import_folder(tree, tmp_path / "many", decode="rgb", seed=5, workers=workers, shard_size="4KB",
                         progress=False)
    assert one["writers"] == 1 and many["writers"] == workers
    assert many["imported"] == one["imported"] == 3 * PER_CLASS + 1
    assert set(many) == set(one)
    _assert_same(tmp_path / "one", tmp_path / "many")
    assert verify(tmp_path / "many", progress=False)["ok"]
    _shards_not_shared(tmp_path / "many")
    _no_leftovers(tmp_path, shm_before)
    with kvdata.open(tmp_path / "many") as store:
        assert store.classes == CLASSES and store.labels.tolist().count(NO_LABEL) == 1  # the loose image: no label


def test_listfile_parts_equal_one_writer(tree: Path, tmp_path: Path) -> None:
    listfile = tmp_path / "list.txt"
    listfile.write_text("".join(f"{c}/{i}.{'png' if i % 2 else 'jpg'} {10 + j}\n"
                                for j, c in enumerate(CLASSES) for i in range(PER_CLASS)))
    shm_before = set(os.listdir("/dev/shm"))
    import_listfile(listfile, tmp_path / "one", root=tree, shuffle=False, workers=0, progress=False)
    s = import_listfile(listfile, tmp_path / "two", root=tree, shuffle=False, workers=2, progress=False)
    assert s["writers"] == 2 and s["classes"] == 13  # labels 10..12 without names: classes "0".."12"
    with kvdata.open(tmp_path / "one") as a, kvdata.open(tmp_path / "two") as b:
        assert list(a.classes) == list(b.classes) == [str(i) for i in range(13)]
    _assert_same(tmp_path / "one", tmp_path / "two")
    assert verify(tmp_path / "two", progress=False)["ok"]
    _no_leftovers(tmp_path, shm_before)


def _with_broken(tree: Path, dst: Path) -> Path:
    dst.mkdir()
    for c in CLASSES:
        (dst / c).mkdir()
        for f in (tree / c).iterdir():
            (dst / c / f.name).write_bytes(f.read_bytes())
    (dst / "cow" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png at all")
    return dst


def test_bad_image_fails_all_or_nothing(tree: Path, tmp_path: Path) -> None:
    src = _with_broken(tree, tmp_path / "src")
    shm_before = set(os.listdir("/dev/shm"))
    with pytest.raises(InvalidValueError, match=r"broken\.png: Pillow cannot decode"):
        import_folder(src, tmp_path / "ds", decode="rgb", workers=2, progress=False)
    assert not os.path.lexists(tmp_path / "ds")
    (tmp_path / "empty").mkdir()  # an empty directory is a new destination too, and stays empty
    with pytest.raises(InvalidValueError, match=r"broken\.png"):
        import_folder(src, tmp_path / "empty", decode="rgb", workers=3, progress=False)
    assert os.listdir(tmp_path / "empty") == []
    _no_leftovers(tmp_path, shm_before)


def test_append_keeps_the_single_writer(tree: Path, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with kvdata.open(ds, "a") as store:  # (an append's records must have the fields the dataset's have)
        store.put("existing", {"image": np.zeros((2, 2, 3), np.uint8), "label": 0}, label=0)
    s = import_folder(tree, ds, decode="rgb", seed=1, workers=2, progress=False, existing="append")
    assert s["writers"] == 1 and s["mode"] == "append" and s["added"] == 3 * PER_CLASS + 1
    import_folder(tree, tmp_path / "fresh", decode="rgb", seed=1, workers=2, progress=False)
    with kvdata.open(ds) as store:
        keys = list(store.keys())
    assert keys == ["existing", *[r[0] for r in _records(tmp_path / "fresh")]]
    assert verify(ds, progress=False)["ok"]
    assert not [p.name for p in tmp_path.iterdir() if ".parts-" in p.name]


def test_cli_json_and_one_line_error(tree: Path, tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    out = cli.ok("import", "folder", tree, "ds", "--decode", "rgb", "--workers", "2", "--json").json()
    assert out["writers"] == 2 and out["imported"] == 3 * PER_CLASS + 1 and out["skipped"] == 0
    src = _with_broken(tree, tmp_path / "src")
    cli.fail("import", "folder", src, "bad", "--decode", "rgb", "--workers", "2", names=["broken.png"])
    assert sorted(os.listdir(tmp_path)) == ["ds", "src"]


def test_interrupt_removes_the_parts(tree: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the parent) mid-import: writers stopped, parts removed, no dataset."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    # a flat 1024x1024 PNG: a few KB on disk (hard links of one file) but a few ms to decode
    Image.new("RGB", (1024, 1024), (9, 99, 199)).save(src / "a" / "0.png")
    for i in range(1, 3000):
        os.link(src / "a" / "0.png", src / "a" / f"{i}.png")
    # SIGINT at its default in the child: a runner started in the background (a shell's `&`)
    # ignores SIGINT, and Python then installs no KeyboardInterrupt handler in what it starts
    p = subprocess.Popen([KVDATA, "import", "folder", str(src), "ds", "--decode", "rgb", "--resize", "4x4",
                          "--workers", "2"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while not any(".parts-" in n for n in os.listdir(tmp_path)) and p.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # the writers are running
        assert p.poll() is None, "the import finished before it could be interrupted"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and b"interrupted" in err and b"Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_progress_bar_counts_the_writers(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's bar advances by the records the writer processes report, to the total."""
    seen: list[tuple[int | None, bool | None, list[int]]] = []

    class Bar:
        def __init__(self, total: int | None, label: str, enabled: bool | None) -> None:
            self.updates: list[int] = []
            seen.append((total, enabled, self.updates))

        def update(self, n: int = 1) -> None:
            self.updates.append(n)

        def close(self) -> None:
            pass

    monkeypatch.setattr(parts, "make_progress", lambda total, label, enabled=None: Bar(total, label, enabled))
    import_folder(tree, tmp_path / "ds", workers=2, progress=True)
    [(total, enabled, updates)] = seen
    assert total == sum(updates) == 3 * PER_CLASS + 1 and enabled is True
    assert all(n >= 0 for n in updates)


def _die_on_second_part(part: str, items: list[int], tick: parts.Tick) -> None:
    if items[0] != 0:
        os._exit(3)  # a writer killed outright: no message to the parent, only EOF
    time.sleep(0.2)


def test_a_dead_writer_fails_the_import(tmp_path: Path) -> None:
    with pytest.raises(KVDataError, match=r"import writer 1 \(items 2-3\) died with exit code 3"):
        parts.write_in_parts(tmp_path / "ds", [0, 1, 2, 3], 2, _die_on_second_part, (),
                             ctx=multiprocessing.get_context("fork"), progress=False)
    assert os.listdir(tmp_path) == []
