"""kvdatad's Prometheus endpoint as operators use it: scraped over HTTP from a real daemon,
parsed by a strict text-format parser, checked by `promtool check metrics`, scraped by a real
Prometheus server whose HTTP API then answers the queries of daemon/grafana-dashboard.json.

One daemon for the module (fixture `live`): two tiers, one named with a quote, a backslash
and a space so label escaping is exercised end to end; a client that reported 1.25 s of
stall and left (the counter must keep it); a reader subprocess paused halfway through a
dataset it reads in random order through the daemon (the per-dataset series).
promtool and prometheus come from Debian's `prometheus` package; without them those tests
skip, saying so.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvdata_daemon.metrics import METRICS

from helpers.daemon import Daemon, Kit, build_dataset, free_port, wait_for

ODD_TIER = 'ssd "nvme" \\ 1'  # its TOML literal below has no escapes: the name holds " and \
DASHBOARD = Path(__file__).resolve().parents[2] / "daemon" / "grafana-dashboard.json"
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


# ------------------------------------------------------------------ a strict text-format parser


class ExpositionError(AssertionError):
    pass


@dataclass
class Family:
    name: str
    kind: str
    help: str | None = None
    samples: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)


def _labels(text: str, lineno: int) -> tuple[tuple[tuple[str, str], ...], str]:
    """Parse `{a="x",b="y"}` at the start of text; returns the labels and the rest."""
    assert text.startswith("{")
    i, out = 1, []
    while True:
        if text[i:i + 1] == "}":
            return tuple(sorted(out)), text[i + 1:]
        m = LABEL_NAME.match(text, i)
        if m is None or text[m.end():m.end() + 2] != '="':
            raise ExpositionError(f"line {lineno}: bad label at {text[i:]!r}")
        name, i, value = m.group(0), m.end() + 2, []
        if name.startswith("__"):
            raise ExpositionError(f"line {lineno}: label {name} is reserved")
        while True:
            c = text[i:i + 1]
            if c == "":
                raise ExpositionError(f"line {lineno}: unterminated label value")
            if c == '"':
                break
            if c == "\\":
                esc = text[i + 1:i + 2]
                if esc not in ("\\", '"', "n"):
                    raise ExpositionError(f"line {lineno}: bad escape \\{esc} in a label value")
                value.append("\n" if esc == "n" else esc)
                i += 2
                continue
            if c == "\n":
                raise ExpositionError(f"line {lineno}: newline in a label value")
            value.append(c)
            i += 1
        if any(k == name for k, _v in out):
            raise ExpositionError(f"line {lineno}: label {name} twice")
        out.append((name, "".join(value)))
        i += 1
        if text[i:i + 1] == ",":
            i += 1


def _float(text: str, lineno: int) -> float:
    if text in ("+Inf", "-Inf", "NaN"):
        return float(text.replace("+", ""))
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise ExpositionError(f"line {lineno}: value {text!r} is not a float")
    return float(text)


def parse_exposition(body: str) -> dict[str, Family]:
    """Text format 0.0.4, strictly: every sample after its family's # TYPE (one TYPE and at most
    one HELP per family, before its samples), valid names, labels and escapes, float values,
    no duplicate series; and our conventions: counters end in _total, gauges do not."""
    if not body.endswith("\n"):
        raise ExpositionError("the body does not end with a newline")
    fams: dict[str, Family] = {}
    helps: dict[str, str] = {}
    sampled: set[str] = set()
    for lineno, line in enumerate(body[:-1].split("\n"), 1):
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                if not METRIC_NAME.fullmatch(name):
                    raise ExpositionError(f"line {lineno}: bad metric name {name!r}")
                if name in sampled:
                    raise ExpositionError(f"line {lineno}: {parts[1]} of {name} after its samples")
                if parts[1] == "HELP":
                    if name in helps:
                        raise ExpositionError(f"line {lineno}: a second HELP for {name}")
                    helps[name] = parts[3] if len(parts) == 4 else ""
                    if "\\" in re.sub(r"\\[\\n]", "", helps[name]):  # only \\ and \n are escapes
                        raise ExpositionError(f"line {lineno}: bad escape in HELP of {name}")
                else:
                    if name in fams:
                        raise ExpositionError(f"line {lineno}: a second TYPE for {name}")
                    kind = parts[3] if len(parts) == 4 else ""
                    if kind not in ("counter", "gauge", "histogram", "summary", "untyped"):
                        raise ExpositionError(f"line {lineno}: unknown type {kind!r}")
                    if (kind == "counter") != name.endswith("_total"):
                        raise ExpositionError(f"line {lineno}: {kind} {name}: only counters end in _total")
                    fams[name] = Family(name, kind)
            continue
        if not line.strip():
            raise ExpositionError(f"line {lineno}: empty line")
        m = METRIC_NAME.match(line)
        if m is None:
            raise ExpositionError(f"line {lineno}: no metric name in {line!r}")
        name, rest = m.group(0), line[m.end():]
        if name not in fams:
            raise ExpositionError(f"line {lineno}: sample of {name} without a preceding # TYPE")
        labels: tuple[tuple[str, str], ...] = ()
        if rest.startswith("{"):
            labels, rest = _labels(rest, lineno)
        fields = rest.split(" ")
        if fields[0] != "" or len(fields) not in (2, 3):
            raise ExpositionError(f"line {lineno}: expected 'name{{labels}} value [timestamp]': {line!r}")
        value = _float(fields[1], lineno)
        if len(fields) == 3 and not re.fullmatch(r"-?\d+", fields[2]):
            raise ExpositionError(f"line {lineno}: bad timestamp {fields[2]!r}")
        if labels in fams[name].samples:
            raise ExpositionError(f"line {lineno}: duplicate series {name}{dict(labels)}")
        if fams[name].kind == "counter" and not value >= 0:
            raise ExpositionError(f"line {lineno}: counter {name} is {value}")
        fams[name].samples[labels] = value
        sampled.add(name)
    for name, text in helps.items():
        if name in fams:
            fams[name].help = text
    return fams


@pytest.mark.parametrize(("body", "why"), [
    ("kvdata_x 1\n", "without a preceding # TYPE"),
    ("# TYPE kvdata_x_total gauge\nkvdata_x_total 1\n", "only counters end in _total"),
    ("# TYPE kvdata_x counter\nkvdata_x 1\n", "only counters end in _total"),
    ("# TYPE kvdata_x gauge\nkvdata_x one\n", "not a float"),
    ('# TYPE kvdata_x gauge\nkvdata_x{t="a\\q"} 1\n', "bad escape"),
    ('# TYPE kvdata_x gauge\nkvdata_x{t="a"} 1\nkvdata_x{t="a"} 2\n', "duplicate series"),
    ('# TYPE kvdata_x gauge\nkvdata_x{t="a} 1\n', "unterminated"),
    ("# TYPE kvdata_x gauge\nkvdata_x 1\n# HELP kvdata_x late\n", "after its samples"),
    ("# TYPE 1kvdata gauge\n", "bad metric name"),
    ("# HELP kvdata_x a \\q\n# TYPE kvdata_x gauge\n", "bad escape in HELP"),
    ("# TYPE kvdata_x gauge\nkvdata_x 1", "newline"),
])
def test_the_parser_rejects_what_prometheus_would(body: str, why: str) -> None:
    with pytest.raises(ExpositionError, match=why):
        parse_exposition(body)


def test_the_parser_reads_escapes_and_special_values() -> None:
    fams = parse_exposition('# HELP kvdata_x a \\\\ b\n# TYPE kvdata_x gauge\n'
                            'kvdata_x{t="a\\"b\\\\c\\nd",u=""} NaN\nkvdata_x{t="z"} -Inf 1700000000\n')
    s = fams["kvdata_x"].samples
    assert math.isnan(s[(("t", 'a"b\\c\nd'), ("u", ""))]) and s[(("t", "z"),)] == -math.inf


# ------------------------------------------------------------------ the live daemon


@dataclass
class Live:
    kit: Kit
    daemon: Daemon
    port: int
    body: str
    status: dict[str, Any]

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            return str(resp.read().decode())


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    kit = Kit(Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp")))
    try:
        kit.config.write_text(kit.config_text().replace('name = "ssd"', f"name = '{ODD_TIER}'"))
        home = build_dataset(kit.root / "home", n=48)
        port = free_port()
        d = kit.daemon(metrics_port=port)
        with d.client() as c:  # a job that stalled 1.25 s and went away
            c.request("announce", dataset=str(home), reader="job", shards=[0, 1], position=0)
            c.request("progress", reader="job", position=1, stall=1.25)
            c.request("progress", reader="job", position=1, stall=0.5)  # a total never shrinks
        go = kit.root / "go"
        reader = kit.reader(home, 48, "--pause-at", "16", "--resume", str(go))
        assert reader.stdout is not None and reader.stdout.readline().strip() == b"paused"
        st = wait_for(lambda: (lambda s: s if any(r.get("mode") == "random" for r in s["datasets"]) else None)(
            d.status()), 10, "the reader's dataset in random mode")
        lv = Live(kit, d, port, "", st)
        lv.body = lv.scrape()
        yield lv
        go.touch()
        out, err = reader.communicate(timeout=30)
        assert reader.returncode == 0, err.decode()[-2000:]
        assert d.terminate() == 0
    finally:
        kit.cleanup()


def value(fams: dict[str, Family], name: str, **labels: str) -> float:
    return fams[name].samples[tuple(sorted(labels.items()))]


def test_live_exposition_is_strict_and_matches_status(live: Live) -> None:
    fams = parse_exposition(live.body)
    assert {n: f.kind for n, f in fams.items()} == {m.name: m.kind for m in METRICS}
    assert all(f.help for f in fams.values())
    st = live.status
    for t in st["tiers"]:  # the odd name comes back exactly, through the escapes
        assert value(fams, "kvdata_tier_budget_bytes", tier=t["name"]) == t["budget"]
        assert value(fams, "kvdata_tier_up", tier=t["name"]) == 1
    assert {t["name"] for t in st["tiers"]} == {"ram", ODD_TIER}
    assert value(fams, "kvdata_reader_stall_seconds_total") == pytest.approx(1.25)
    assert value(fams, "kvdata_clients_connected") >= 1
    assert value(fams, "kvdata_hits_total") + value(fams, "kvdata_misses_total") > 0
    assert value(fams, "kvdata_staged_bytes_total") == st["bytes_staged"] > 0
    assert value(fams, "kvdata_home_read_bytes_total") > 0
    assert value(fams, "kvdata_staging_workers") >= 1
    [(labels, one)] = fams["kvdata_build_info"].samples.items()
    assert one == 1 and labels[0][0] == "version" and labels[0][1]
    assert abs(value(fams, "kvdata_start_time_seconds") - time.time()) < 600
    row = next(r for r in st["datasets"] if r.get("mode") == "random")
    key = row["key"]
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert value(fams, "kvdata_dataset_random_order", dataset=key) == 1
    assert value(fams, "kvdata_dataset_resident_budget_bytes", dataset=key) == row["resident_budget"] > 0
    assert value(fams, "kvdata_dataset_resident_shards", dataset=key) == row["resident_shards"]
    assert str(live.kit.root) not in live.body  # no paths: the endpoint is readable by every local user


def test_reader_stall_is_a_counter_across_clients(live: Live) -> None:
    before = value(parse_exposition(live.scrape()), "kvdata_reader_stall_seconds_total")
    with live.daemon.client() as c:
        c.request("progress", reader="job2", position=0, stall=0.5)
    after = wait_for(lambda: (lambda v: v if v >= before + 0.5 - 1e-6 else None)(
        value(parse_exposition(live.scrape()), "kvdata_reader_stall_seconds_total")), 5, "the stall counter")
    assert after == pytest.approx(before + 0.5)


def test_promtool_check_metrics(live: Live) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "metrics"], input=live.body, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    # and promtool does catch what we avoid (so a clean pass means something)
    bad = "# HELP kvdata_bad_total x\n# TYPE kvdata_bad_total gauge\nkvdata_bad_total 1\n"
    r = subprocess.run([promtool, "check", "metrics"], input=bad, capture_output=True, text=True, timeout=20)
    assert r.returncode != 0 and "kvdata_bad_total" in r.stdout + r.stderr


def _api(port: int, query: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as resp:
        return dict(json.loads(resp.read()))


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_a_real_prometheus_scrapes_kvdatad_and_answers_the_dashboard(live: Live, tmp_path: Path) -> None:
    prom = shutil.which("prometheus")
    if prom is None:
        pytest.skip("the prometheus server is not installed (Debian: apt-get install prometheus)")
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   "scrape_configs:\n  - job_name: kvdatad\n    static_configs:\n"
                   f"      - targets: ['127.0.0.1:{live.port}']\n")
    log = (tmp_path / "prometheus.log").open("wb")
    p = subprocess.Popen([prom, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         cwd=tmp_path)
    try:
        def budget() -> list[Any] | None:
            if p.poll() is not None:
                raise AssertionError(f"prometheus exited {p.returncode}: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            try:
                r = _api(port, "kvdata_tier_budget_bytes")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return None
            return list(r["data"]["result"]) or None

        got = wait_for(budget, 20, "kvdata_tier_budget_bytes through Prometheus' API", interval=0.2)
        by_tier = {s["metric"]["tier"]: float(s["value"][1]) for s in got}
        assert by_tier == {t["name"]: float(t["budget"]) for t in live.status["tiers"]}
        assert all(s["metric"]["job"] == "kvdatad" for s in got)
        up = _api(port, 'up{job="kvdatad"}')["data"]["result"]
        assert [float(s["value"][1]) for s in up] == [1.0]
        # every dashboard query is valid PromQL over these series (Grafana's $__rate_interval and
        # template variables filled in as Grafana would)
        for title, expr in _dashboard_queries():
            q = expr.replace("$__rate_interval", "10s").replace("$instance", ".*")
            r = _api(port, q)
            assert r["status"] == "success", (title, q, r)
        stall = _api(port, "kvdata_reader_stall_seconds_total")["data"]["result"]
        assert float(stall[0]["value"][1]) >= 1.25
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        log.close()
