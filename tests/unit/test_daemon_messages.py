"""kvdatad's typed requests and replies (kvdata_daemon.messages, issue 28 item 2): a frame's map is
decoded once at the edge with the one-line errors the handlers gave when they read raw maps; what
depends on the daemon's state (a shard id's range, a passed file's kind) decodes leniently so the
handlers refuse it as before; replies put the fields the handlers' dicts had on the wire, in the same
order, so the frames are the same bytes. tests/integration/test_daemon*.py run them end to end.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from kvdata.errors import BadRequest
from kvdata.protocol import MAX_FDS, PROTOCOL_VERSION, TYPES, encode
from kvdata_daemon import messages as m

DS = "/data/ds"
SHA = "ab" * 32


def dec(t: str, msg: dict[str, Any], nfds: int = 0, paths: bool = True) -> m.Request:
    """`msg` decoded as a request of type t with nfds descriptors (numbers only: never closed here),
    from a peer that may (paths) or may not name local paths."""
    return m.decode(t, msg, m.Passed(list(range(1000, 1000 + nfds))), paths)


MINIMAL: dict[str, tuple[dict[str, Any], type]] = {
    "hello": ({"version": PROTOCOL_VERSION}, m.HelloRequest),
    "open": ({"dataset": DS}, m.OpenRequest),
    "announce": ({"dataset": DS, "reader": "r", "shards": []}, m.AnnounceRequest),
    "progress": ({"reader": "r"}, m.ProgressRequest),
    "need": ({"dataset": DS, "shard": 0}, m.NeedRequest),
    "want": ({"dataset": DS, "shards": []}, m.WantRequest),
    "release": ({"reader": "r"}, m.ReleaseRequest),
    "stage": ({"dataset": DS}, m.StageRequest),
    "evict": ({"dataset": DS}, m.EvictRequest),
    "status": ({}, m.StatusRequest),
    "reload": ({}, m.ReloadRequest),
}


def test_every_message_type_of_the_protocol_decodes_to_its_request_type() -> None:
    assert set(MINIMAL) == set(TYPES)
    for t, (msg, cls) in MINIMAL.items():
        assert type(dec(t, msg)) is cls, t


@pytest.mark.parametrize("t, msg, nfds, paths, error", [
    ("open", {"dataset": 5}, 0, True, "dataset must be a non-empty string without NUL bytes"),
    ("open", {"dataset": "rel/path"}, 0, True,
     "dataset 'rel/path' must be an absolute path or an s3:// / http(s):// URL"),
    ("evict", {"dataset": "/a/../b"}, 0, True, "dataset path '/a/../b' may not contain '..'"),
    ("announce", {"dataset": DS, "reader": "", "shards": [0]}, 0, True, "reader must be a short non-empty string"),
    ("announce", {"dataset": DS, "reader": "x" * 257, "shards": [0]}, 0, True,
     "reader must be a short non-empty string"),
    ("announce", {"dataset": DS, "reader": "r", "shards": "0,1"}, 0, True, "shards must be a list of integer shard ids"),
    ("announce", {"dataset": DS, "reader": "r", "shards": [0], "position": None}, 0, True,
     "position must be a non-negative integer"),
    ("announce", {"dataset": DS, "reader": "r", "shards": [0], "next_start": 2}, 0, True,
     "next_start must be an integer index into shards (0..1), not 2"),
    ("announce", {"dataset": DS, "reader": "r", "shards": [0], "next_start": True}, 0, True,
     "next_start must be an integer index into shards (0..1), not True"),
    ("announce", {"dataset": DS, "reader": "r", "shards": [0], "ahead": [[0, "mdb"]]}, 0, True,
     "ahead must be a list of [shard id, kind] pairs, one per descriptor passed"),
    ("announce", {"dataset": DS, "reader": "r", "shards": [0], "ahead": [[0, "mdb", 1]]}, 1, False,
     "ahead must be a list of [shard id, kind] pairs"),
    ("progress", {"reader": "r", "position": 1.5}, 0, True, "position must be a non-negative integer"),
    ("progress", {"reader": "r", "ahead": []}, 0, True, "dataset must be a non-empty string without NUL bytes"),
    ("need", {"dataset": DS, "shard": 0, "sha256": "A" * 64}, 0, True, "sha256 must be 64 lowercase hex digits"),
    ("need", {"dataset": DS, "shard": 0, "progress": [["r"]]}, 0, True,
     "progress must be a list of [reader, position] pairs"),
    ("need", {"dataset": DS, "shard": 0, "progress": [["r", 0]] * 65}, 0, True,
     "progress must be a list of at most 64 [reader, position] pairs"),
    ("want", {"dataset": DS, "shards": [], "progress": [["r", -1]]}, 0, True, "position must be a non-negative integer"),
    ("want", {"dataset": DS, "shards": [[0]]}, 0, True, "shards must be a list of [id, sha256] pairs"),
    ("want", {"dataset": DS, "shards": [[0, SHA]], "kinds": ["mdb"]}, 0, True,
     "kinds must name the kind of each descriptor passed, in the order of shards"),
    ("release", {"reader": "a\x00b"}, 0, True, "reader must be a short non-empty string"),
    ("stage", {"dataset": DS, "tier": 5}, 0, True, "tier must be a tier name"),
    ("stage", {"dataset": DS, "ahead": 5}, 0, False,
     "ahead must be a list of [shard id, kind] pairs, one per descriptor passed"),
    ("hello", {"version": 99}, 0, True, "protocol version 99 is not 2; upgrade kvdata"),
    ("hello", {}, 0, True, "protocol version None is not 2; upgrade kvdata"),
])
def test_a_field_that_is_wrong_is_refused_in_one_line_naming_it(t: str, msg: dict[str, Any], nfds: int, paths: bool,
                                                               error: str) -> None:
    with pytest.raises(BadRequest) as e:
        dec(t, msg, nfds, paths)
    assert str(e.value) == error


def test_what_the_handlers_check_against_their_state_is_decoded_leniently() -> None:
    """A shard id that is not an integer is None (refused by the range check, naming the range); a
    kind that is neither mdb nor zst is None (refused where its file would be held, and only there:
    a want's descriptor for a shard whose sha256 does not match is closed unread)."""
    a = dec("announce", {"dataset": DS, "reader": "r", "shards": [0, True, "1", None, 2**64]})
    assert isinstance(a, m.AnnounceRequest) and a.shards == (0, None, None, None, 2**64) and a.position == 0
    n = dec("need", {"dataset": DS, "shard": [0], "sha256": SHA})
    assert isinstance(n, m.NeedRequest) and n.shard is None and n.shard_named == "[0]" and n.kind == "mdb"
    assert isinstance(k := dec("need", {"dataset": DS, "shard": 3, "kind": 7}), m.NeedRequest) and k.kind is None
    w = dec("want", {"dataset": DS, "shards": [[0, SHA], [1, 5]], "kinds": ["bogus"]}, nfds=1)
    assert isinstance(w, m.WantRequest)
    assert w.shards == (m.WantedShard(0, SHA), m.WantedShard(1, None)) and w.kinds == (None,)


def test_shard_files_are_read_only_where_the_daemon_reads_the_dataset_from_them() -> None:
    """`ahead`'s items matter only for a local dataset of a peer that may not name paths; any
    other peer's descriptors are not needed (closed after the reply), its items not looked at."""
    msg = {"dataset": DS, "reader": "r", "shards": [0, 1], "ahead": [[1, "zst"], ["x"]]}
    a = dec("announce", msg, nfds=2, paths=True)
    assert isinstance(a, m.AnnounceRequest) and a.ahead == ()
    url = dec("announce", {**msg, "dataset": "s3://bucket/ds"}, nfds=2, paths=False)
    assert isinstance(url, m.AnnounceRequest) and url.ahead == ()
    with pytest.raises(BadRequest, match=r"^ahead must be a list of \[shard id, kind\] pairs$"):
        dec("announce", msg, nfds=2, paths=False)
    ok = dec("announce", {**msg, "ahead": [[1, "zst"], [True, "x"]]}, nfds=2, paths=False)
    assert isinstance(ok, m.AnnounceRequest) and ok.ahead == (m.ShardFile(1, "zst"), m.ShardFile(None, None))
    s = dec("stage", {"dataset": DS, "ahead": 5, "wait": [1]}, paths=True)
    assert isinstance(s, m.StageRequest) and s.ahead is None and s.wait is True
    p = dec("progress", {"reader": "r", "position": 3, "ahead": [], "dataset": DS, "stall": True})
    assert isinstance(p, m.ProgressRequest) and p.prefetch == m.Prefetch(DS, ()) and p.stall is None
    q = dec("progress", {"reader": "r", "stall": 2})
    assert isinstance(q, m.ProgressRequest) and q.stall == 2.0 and q.prefetch is None and q.position == 0
    big = dec("stage", {"dataset": DS, "ahead": [[0, "mdb"]] * (MAX_FDS + 1)}, nfds=MAX_FDS + 1, paths=True)
    assert isinstance(big, m.StageRequest) and big.ahead is None  # (a privileged peer's stage never reads them)


def test_replies_put_the_handlers_fields_on_the_wire_in_the_same_order() -> None:
    def frame(reply: m.Reply) -> bytes:
        return encode({"id": 1, "ok": True, **reply.wire()})

    assert frame(m.Done()) == encode({"id": 1, "ok": True})
    assert frame(m.HelloReply(2, 10, 1000, False)) == encode({"id": 1, "ok": True, "version": 2, "pid": 10,
                                                              "uid": 1000, "paths": False})
    need = m.NeedReply("/t/x.mdb", False, 7, congested=True)
    assert frame(need) == encode({"id": 1, "ok": True, "path": "/t/x.mdb", "staged": False, "congested": True})
    assert need.descriptors() == [7]
    assert list(m.NeedReply("/t/x.mdb", True, 7, congested=False).wire()) == ["path", "staged"]
    opened = m.OpenReply("/m", 3, 2, (("manifest.json", 5), ("index/a", 6)))
    assert frame(opened) == encode({"id": 1, "ok": True, "root": "/m", "generation": 3, "shards": 2,
                                    "files": ["manifest.json", "index/a"]})
    assert opened.descriptors() == [5, 6] and m.OpenReply("/d", 1, 2).descriptors() == []
    assert list(m.OpenReply("/d", 1, 2).wire()) == ["root", "generation", "shards"]
    congested = m.WantReply(0, m.ReadMode("random", SHA, staged=b"\x01"))
    assert list(congested.wire().items()) == [("started", 0), ("mode", "random"), ("resident_below", SHA),
                                              ("congested", True), ("staged", b"\x01")]
    assert list(m.WantReply(0, m.ReadMode("shard-aware", "", whole=b"\x03")).wire()) == [
        "started", "mode", "resident_below", "whole"]
    assert m.WantReply(4).wire() == {"started": 4}
    job: Future[Path] = Future()
    assert frame(m.StageReply(3, 1, (job,))) == encode({"id": 1, "ok": True, "shards": 3, "queued": 1})
    assert frame(m.EvictReply(2, 1)) == encode({"id": 1, "ok": True, "evicted": 2, "kept": 1})
    assert frame(m.ReloadReply(("ram", "ssd"))) == encode({"id": 1, "ok": True, "tiers": ["ram", "ssd"]})
    assert frame(m.StatusReply({"tiers": [], "pid": 1})) == encode({"id": 1, "ok": True, "tiers": [], "pid": 1})
