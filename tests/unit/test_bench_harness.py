"""The pure helpers of the bench harness (bench/_common.py, bench/run_all.py): medians, markdown
tables, README block replacement, parsing tables back for the plots. No bench is run."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


common = _load("_common")


# ---------------------------------------------------------------- statistics and timing

def test_median_odd_even_nan_empty():
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    assert common.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert common.median([1.0, float("nan"), 3.0]) == 2.0  # NaN ignored
    assert math.isnan(common.median([]))
    assert math.isnan(common.median([float("nan")]))
    assert common.median(x for x in (5, 7)) == 6  # any iterable


def test_quantile_sorted_matches_the_benches_formula():
    w = sorted([0.5, 0.1, 0.3, 0.2])
    assert common.quantile_sorted(w, 0.5) == w[len(w) // 2]
    assert common.quantile_sorted(w, 0.99) == w[min(len(w) - 1, int(len(w) * 0.99))]
    assert common.quantile_sorted(w, 1.0) == w[-1]
    assert math.isnan(common.quantile_sorted([], 0.5))


def test_rotated_and_repeat_rotated():
    assert common.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert common.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert common.rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert common.rotated([], 3) == []
    calls = []
    out = common.repeat_rotated(["a", "b", "c"], 3, lambda n, r: calls.append((r, n)) or 10 * r + ord(n))
    assert [n for r, n in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert list(out) == ["a", "b", "c"]  # values per name, in repeat order
    assert out["b"] == [ord("b"), 10 + ord("b"), 20 + ord("b")]


def test_timed_returns_seconds_and_result():
    dt, res = common.timed(lambda x, y=1: x + y, 2, y=3)
    assert res == 5 and 0 <= dt < 5


def test_machine_info_has_the_basics():
    info = common.machine_info(("numpy", "surely_not_a_module_xyz"))
    assert info["cpus"] and info["python"] and info["kernel"] is not None
    assert info["versions"]["numpy"] == np.__version__
    assert info["versions"]["surely_not_a_module_xyz"] is None
    line = common.machine_line(info)
    assert f"{info['cpus']} CPUs" in line and f"numpy {np.__version__}" in line
    assert "surely_not_a_module_xyz" not in line


# ---------------------------------------------------------------- seeded data

@pytest.mark.parametrize("content", ["noise", "random", "photo", "smooth"])
def test_make_images_is_seeded(content):
    a = common.make_images(np.random.default_rng(7), 3, content)
    b = common.make_images(np.random.default_rng(7), 3, content)
    assert a.shape == (3, 227, 227, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, common.make_images(np.random.default_rng(8), 3, content))


def test_make_images_keeps_the_old_byte_streams():
    # store_read/staging/daemon drew uniform bytes and "photo" images with exactly these calls
    rng = np.random.default_rng(0)
    want = rng.integers(0, 256, size=(2, 1024), dtype=np.uint8)
    assert np.array_equal(common.make_images(np.random.default_rng(0), 2, "noise", (1024,)), want)
    rng = np.random.default_rng([0, 1])
    base = rng.integers(0, 208, size=(2, 1, 1, 3), dtype=np.uint8)
    want = base + rng.integers(0, 48, size=(2, 227, 227, 3), dtype=np.uint8)
    assert np.array_equal(common.make_images(np.random.default_rng([0, 1]), 2, "photo"), want)
    with pytest.raises(ValueError):
        common.make_images(np.random.default_rng(0), 1, "plaid")


def test_image_chunks_cover_n():
    chunks = list(common.image_chunks(np.random.default_rng(0), 5, 2, shape=(4,)))
    assert [s for s, _ in chunks] == [0, 2, 4]
    assert [len(a) for _, a in chunks] == [2, 2, 1]


def test_built_and_mark_built(tmp_path):
    done, out = tmp_path / "DONE.json", tmp_path / "data"
    assert common.built(done, {"n": 1}) is None
    rec = common.mark_built(done, {"n": 1}, shards=3)
    assert rec == {"params": {"n": 1}, "shards": 3}
    assert common.built(done, {"n": 1}) == rec
    assert common.built(done, {"n": 2}) is None          # other parameters: build again
    assert common.built(done, {"n": 1}, out) is None     # an output is gone: build again
    out.mkdir()
    assert common.built(done, {"n": 1}, out) == rec
    done.write_text("not json")
    assert common.built(done, {"n": 1}) is None


# ---------------------------------------------------------------- markdown tables

def test_md_table_alignment_and_cells():
    t = common.md_table(["method", "kind", "MB/s"], [["a", "x", "1,234"], ["b", "y", 5]], left=2)
    assert t == ("| method | kind | MB/s |\n"
                 "|---|---|---:|\n"
                 "| a | x | 1,234 |\n"
                 "| b | y | 5 |\n")
    assert common.md_table(["a", "b"], []).splitlines()[1] == "|---|---:|"


def test_md_tables_parses_what_md_table_writes():
    md = ("## title\n\nsome prose | with a pipe\n\n#### (a) first\n\n"
          + common.md_table(["method", "samples/s", "vs base"], [["m1", "1,000", "1.00x"], ["m2", "2,500", "2.50x"]])
          + "\n```\n| not | a table |\n|---|---|\n```\n\n### second\n\n"
          + common.md_table(["window", "mean"], [["1", "1.2 (1)"]]))
    ts = common.md_tables(md)
    assert [t.heading for t in ts] == ["(a) first", "second"]
    assert ts[0].header == ["method", "samples/s", "vs base"]
    assert ts[0].rows == [["m1", "1,000", "1.00x"], ["m2", "2,500", "2.50x"]]
    assert ts[0].col("VS") == 2
    with pytest.raises(KeyError):
        ts[0].col("nope")


@pytest.mark.parametrize("cell,want", [("1,234", 1234.0), ("1.08x", 1.08), ("99.886%", 99.886), ("+0.105", 0.105),
                                       ("-29.61", -29.61), ("138 / 138", 138.0), ("**2.0x**", 2.0),
                                       ("10% (100)", 10.0), ("1e-3", 0.001)])
def test_num(cell, want):
    assert common.num(cell) == pytest.approx(want)


def test_num_without_a_number_is_nan():
    assert math.isnan(common.num("-"))
    assert math.isnan(common.num(""))


# ---------------------------------------------------------------- README blocks

DOC = """# Title

prose before

<!-- bench:a:begin -->
old a
<!-- bench:a:end -->

between

<!-- bench:b:begin -->
old b
<!-- bench:b:end -->
tail prose
"""


def test_replace_block_keeps_everything_outside():
    begin, end = common.block_markers("a")
    assert (begin, end) == ("<!-- bench:a:begin -->", "<!-- bench:a:end -->")
    out = common.replace_block(DOC, begin, end, "\nnew a\n| x |\n\n")
    assert out == DOC.replace("old a", "new a\n| x |")
    again = common.replace_block(out, begin, end, "new a\n| x |")
    assert again == out  # idempotent
    assert common.read_blocks(out) == {"a": "new a\n| x |", "b": "old b"}


def test_replace_block_body_with_backslashes_and_group_refs():
    begin, end = common.block_markers("b")
    body = r"C:\path \1 \g<0> $1"
    out = common.replace_block(DOC, begin, end, body)
    assert common.read_blocks(out)["b"] == body


def test_replace_block_missing_or_duplicate():
    with pytest.raises(KeyError):
        common.replace_block(DOC, *common.block_markers("zzz"), "x")
    doubled = DOC + "<!-- bench:a:begin -->\nx\n<!-- bench:a:end -->\n"
    with pytest.raises(ValueError):
        common.replace_block(doubled, *common.block_markers("a"), "y")


def test_demote_headings():
    md = "## kvdata x (machine)\n\n### (a) part\n\n#### sub\n\n```\n## not a heading\n```\ntext # no"
    assert common.demote_headings(md) == "#### (a) part\n\n#### sub\n\n```\n## not a heading\n```\ntext # no"


# ---------------------------------------------------------------- run_all

def test_run_all_render_and_update(tmp_path):
    run_all = _load("run_all")
    readme = tmp_path / "README.md"
    readme.write_text(DOC.replace("bench:a:", "bench:store_read:").replace("bench:b:", "bench:crash_kill:"))
    table = common.md_table(["method", "samples/s (median)", "vs np.memmap + offsets"],
                            [["np.memmap + offsets", "10", "1.00x"]])
    md = "## kvdata store_read (m)\n\n### (a) warm\n\n" + table
    data = {"config": {"quick": "True"}, "machine": {"host": "h", "cpus": 2, "python": "3", "kernel": "k"},
            "markdown": md}
    done = run_all.update_readme(readme, {"store_read": data}, "2026-01-01")
    assert done == ["store_read"]
    blocks = common.read_blocks(readme.read_text())
    assert blocks["crash_kill"] == "old b"                       # other blocks untouched
    text = blocks["store_read"]
    assert run_all.block_is_quick(text) and "Quick mode" in text  # labelled
    assert "#### (a) warm" in text and "## kvdata" not in text
    assert "![store_read (quick mode)](plots/store_read.png)" in text
    assert "python bench/store_read.py --quick --json bench/out/store_read.json" in text
    assert "prose before" in readme.read_text() and "tail prose" in readme.read_text()
    data["config"]["quick"] = "False"
    run_all.update_readme(readme, {"store_read": data}, "2026-01-02")
    text = common.read_blocks(readme.read_text())["store_read"]
    assert not run_all.block_is_quick(text) and "Quick mode" not in text
    tables = common.md_tables(text)
    assert tables[0].heading == "(a) warm" and tables[0].rows[0][2] == "1.00x"


def test_every_bench_has_a_block_in_the_readme():
    run_all = _load("run_all")
    blocks = run_all.read_pages(BENCH / "results")
    assert set(blocks) == {b.name for b in run_all.BENCHES}
    for b in run_all.BENCHES:
        if b.plot:
            assert f"(plots/{b.name}.png)" in blocks[b.name]


def test_each_bench_script_has_one_results_page_linked_from_the_readme():
    """bench/README.md is the one page of targets and links; each script's blocks live on its own
    page (bench/results/<script>.md), none in the README."""
    run_all = _load("run_all")
    readme = (BENCH / "README.md").read_text()
    assert common.read_blocks(readme) == {}
    pages = {b.page for b in run_all.BENCHES}
    for page in pages:
        assert (BENCH / "results" / page).is_file(), page
        assert f"(results/{page})" in readme, f"bench/README.md does not link results/{page}"
    for name, text in run_all.read_pages(BENCH / "results").items():
        path = BENCH / "results" / run_all.BY_NAME[name].page
        assert common.read_blocks(path.read_text())[name] == text  # each block on its own script's page
