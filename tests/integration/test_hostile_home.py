"""A hostile HTTP home on 127.0.0.1 serving crafted manifests: the CLI (as the user) and kvdatad
(as the daemon's user) validate every name before any file is created, written or deleted.

Regression for issue 11's first class: index file names from a remote manifest were used as
paths before the manifest was validated (`..` segments, absolute names), so a home could make
the mirror write any bytes anywhere; `kvdata evict URL` deleted `*.mdb` files named through a
manifest's sha256 field."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvdata.errors import DaemonError
from kvdata.sync.push import push

from helpers.common import free_port
from helpers.daemon import Kit, build_dataset


class _Home(BaseHTTPRequestHandler):
    root: Path = Path("/nonexistent")

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        p = self.root / self.path.lstrip("/")
        if ".." in self.path or not p.is_file():
            self.send_error(404)
            return
        data = p.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """(URL, the served directory, a bystander directory that must never change)."""
    www = tmp_path / "www"
    src = build_dataset(tmp_path / "src", n=24)
    push(src, str(www / "ds"), show=False)

    class Files(_Home):
        root = www

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Files)
    server.daemon_threads = True
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    bystander = tmp_path / "bystander"
    bystander.mkdir()
    (bystander / "precious.mdb").write_bytes(b"keep me")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/ds", www / "ds", bystander
    finally:
        server.shutdown()
        server.server_close()
        th.join(10)


def _listing(root: Path) -> dict[str, bytes]:
    """Every file under root but the tiers' (empty) lock files."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(".lock")}


def _crafted(served: Path, pristine: dict, bystander: Path) -> Iterator[tuple[str, dict]]:
    victim = str(bystander / "escape.bin")
    depth = "../" * 12
    for field, name in (("samples", f"{depth}{victim.lstrip('/')}"), ("samples", victim),
                        ("records", "../../escape.bin"), ("keys", f"{depth}tmp/escape.bin"),
                        ("shard", "../../escape.mdb"), ("zst", victim), ("tail", "../tail-000001.mdb")):
        m = json.loads(json.dumps(pristine))
        if field in ("samples", "records"):
            m["index"][field] = name
        elif field == "keys":
            m["index"]["keys"][0]["name"] = name
        elif field == "shard":
            m["shards"][0]["name"] = name
        elif field == "zst":
            m["shards"][0]["zst"]["name"] = name
        else:
            m["tail"]["name"] = name
        yield f"{field}={name}", m
    m = json.loads(json.dumps(pristine))  # a sha256 naming a file the user has elsewhere
    m["shards"][0]["sha256"] = "../../bystander/precious"
    yield "sha256 path", m


def test_crafted_manifests_from_an_http_home_write_and_delete_nothing_outside(hostile: tuple[str, Path, Path],
                                                                             kit: Kit, tmp_path: Path) -> None:
    url, served, bystander = hostile
    pristine = json.loads((served / "manifest.json").read_text())
    tiers_before = {t: _listing(p) if p.exists() else {} for t, p in kit.tiers.items()}
    outside = tmp_path.parent
    before_outside = sorted(os.listdir(outside))
    before = _listing(bystander)
    env = kit.env(XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    for what, m in _crafted(served, pristine, bystander):
        (served / "manifest.json").write_text(json.dumps(m))
        for args in (("info", url), ("ls", url), ("get", url, "k000000"), ("stage", url), ("evict", url),
                     ("verify", url)):
            r = kit.kvdata(*args, env=env)
            assert r.returncode != 0, (what, args, r.stdout, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, (what, args, r.stderr)
        assert _listing(bystander) == before, what
        assert not list(tmp_path.rglob("escape*")), what
        assert sorted(os.listdir(outside)) == before_outside, what
    for t, p in kit.tiers.items():
        assert (_listing(p) if p.exists() else {}) == tiers_before[t]


def test_kvdatad_refuses_crafted_manifests_and_writes_nothing_outside(hostile: tuple[str, Path, Path],
                                                                      kit: Kit, tmp_path: Path) -> None:
    url, served, bystander = hostile
    pristine = json.loads((served / "manifest.json").read_text())
    kit.config.write_text(kit.config_text(extra=f'[daemon]\nallow_homes = ["{url.rsplit("/", 1)[0]}/"]\n'))
    d = kit.daemon()
    before = _listing(bystander)
    try:
        for what, m in _crafted(served, pristine, bystander):
            (served / "manifest.json").write_text(json.dumps(m))
            for t, fields in (("open", {}), ("stage", {"wait": True}), ("evict", {})):
                with pytest.raises(DaemonError):
                    d.request(t, dataset=url, **fields)
            assert _listing(bystander) == before, what
            assert not list(tmp_path.rglob("escape*")), what
        # the pristine manifest still works: the refusals held no state
        (served / "manifest.json").write_text(json.dumps(pristine))
        assert d.request("stage", dataset=url, wait=True)["shards"] == len(pristine["shards"])
    finally:
        assert d.terminate() == 0
    shutil.rmtree(tmp_path / "www", ignore_errors=True)
