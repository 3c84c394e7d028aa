"""Fuzz the manifest decoder (kvdata/format/manifest.py): random JSON, mutated valid manifests
(names with '..', '/', absolute paths, huge numbers, wrong types, deep nesting), then the same
manifests inside a real dataset opened by readers, the index mirror and a writer, with HOME,
XDG_* and the working directory in a temp root: only KVDataError may escape, every accepted
name stays a plain file name, and nothing is written outside the temp root."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdata.errors import CorruptDatasetError, FormatVersionError
from kvdata.format.manifest import manifest_from_json, parse_manifest

import fuzzlib as fl
from fuzzlib import fuzz_settings


@pytest.fixture(scope="module")
def ctx() -> Iterator[fl.Ctx]:
    with fl.context() as c:
        yield c


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from(fl.hostile_names("/tmp/kvfuzz-parent")),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20)


def test_fuzz_manifest_random_json() -> None:
    @fuzz_settings(200)
    @given(_json)
    def case(value: Any) -> None:
        try:
            manifest_from_json(value, "fuzz")
        except CorruptDatasetError:
            pass
        try:
            parse_manifest(json.dumps(value).encode(), "fuzz")
        except CorruptDatasetError:
            pass
    case()


def test_fuzz_manifest_mutated(ctx: fl.Ctx) -> None:
    @fuzz_settings(400)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("manifest_json", fl.TARGETS["manifest_json"].gen(r, ctx), ctx)
    case()


def test_fuzz_manifest_in_a_dataset_read_mirrored_and_written(ctx: fl.Ctx) -> None:
    @fuzz_settings(40)
    @given(st.randoms(use_true_random=False))
    def case(r: Any) -> None:
        fl.check("manifest_store", fl.TARGETS["manifest_store"].gen(r, ctx), ctx)
        ctx.sandbox.clean_work()
    case()


@pytest.mark.parametrize("where", ["shard", "zst", "tail", "samples", "records", "keys", "index_sha256"])
def test_hostile_name_in_any_name_field_is_refused_or_stays_a_plain_name(ctx: fl.Ctx, where: str) -> None:
    for name in fl.hostile_names(ctx.sandbox.parent):
        m = json.loads(json.dumps(fl.pristine_manifest(ctx)))
        if where == "shard":
            m["shards"][0]["name"] = name
        elif where == "zst":
            m["shards"][0]["zst"]["name"] = name
        elif where == "tail":
            m["tail"]["name"] = name
        elif where in ("samples", "records"):
            m["index"][where] = name
        elif where == "keys":
            m["index"]["keys"][0]["name"] = name
        else:
            m["index_sha256"] = {name: "0" * 64}
        try:
            fl.check("manifest_json", m, ctx)  # accepted names must be plain names under their directory
        except AssertionError as e:
            raise AssertionError(f"{where} = {name!r}: {e}") from None
        if "/" in name or name in ("", ".", "..") or "\x00" in name:
            with pytest.raises(CorruptDatasetError, match="bad field"):
                manifest_from_json(m, "fuzz")


# ---------------------------------------------------------------- regressions, one per bug


def test_manifest_with_an_integer_of_5000_digits_is_corrupt_not_valueerror() -> None:
    """json.loads refuses integers of more than 4300 digits with a plain ValueError."""
    for doc in (b'{"format":"kvdata","version":1,"count":' + b"9" * 5000 + b"}",
                b'{"format":"kvdata","version":' + b"9" * 5000 + b"}"):
        with pytest.raises(CorruptDatasetError, match="truncated or corrupt"):
            parse_manifest(doc, "m.json")


def test_manifest_error_shows_a_huge_integer_in_one_short_line_not_valueerror(ctx: fl.Ctx) -> None:
    m = dict(fl.pristine_manifest(ctx), count=10 ** 5000)
    with pytest.raises(CorruptDatasetError, match="a 16610-bit integer") as e:
        manifest_from_json(m, "m.json")
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)
    with pytest.raises(FormatVersionError, match="a 16610-bit integer"):
        manifest_from_json(dict(m, version=10 ** 5000), "m.json")


@pytest.mark.parametrize("field", ["classes", "fields", "extra", "shard-name", "tail-name", "index-name", "key-run"])
def test_manifest_with_deep_nesting_is_corrupt_not_recursionerror(ctx: fl.Ctx, field: str) -> None:
    deep = fl.deep(5000)
    m = json.loads(json.dumps(fl.pristine_manifest(ctx)))
    if field == "classes":
        m["classes"] = [deep]
    elif field == "fields":
        m["fields"]["image"] = {"type": "array", "dtype": "|u1", "shape": deep}
    elif field == "extra":
        m["future_key"] = deep
    elif field == "shard-name":
        m["shards"][0]["name"] = deep
    elif field == "tail-name":
        m["tail"]["name"] = deep
    elif field == "index-name":
        m["index"]["samples"] = deep
    else:
        m["index"]["keys"][0] = deep
    with pytest.raises(CorruptDatasetError, match="bad field"):
        manifest_from_json(m, "m.json")


@pytest.mark.parametrize("spec", [5, "array", [1], {"dtype": "|u1"}, {"type": 3}, {"type": "array", "shape": "3"},
                                  {"type": "array", "shape": [-1]}, {"type": "array", "shape": [True]},
                                  {"type": "array", "dtype": ["|u1"]}])
def test_manifest_field_schema_that_is_not_one_is_corrupt(ctx: fl.Ctx, spec: Any) -> None:
    """A writer merges new records' schemas into these (merge_schema): garbage there crashed it."""
    m = dict(fl.pristine_manifest(ctx), fields={"image": spec})
    with pytest.raises(CorruptDatasetError, match=r"fields\["):
        manifest_from_json(m, "m.json")


def test_manifest_classes_keep_their_text_and_refuse_containers(ctx: fl.Ctx) -> None:
    m = manifest_from_json(dict(fl.pristine_manifest(ctx), classes=["cat", 7, 1.5]), "m.json")
    assert m.classes == ("cat", "7", "1.5")
    for bad in ([["cat"]], [{"a": 1}], [None], [True], [1 << 70]):
        with pytest.raises(CorruptDatasetError, match="classes"):
            manifest_from_json(dict(fl.pristine_manifest(ctx), classes=bad), "m.json")


def test_valid_manifest_round_trips(ctx: fl.Ctx) -> None:
    m = manifest_from_json(fl.pristine_manifest(ctx), "m.json")
    assert manifest_from_json(json.loads(json.dumps(m.to_json())), "again") == m
