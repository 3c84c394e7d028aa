"""daemon/grafana-dashboard.json against the daemon's own exposition (kvdata_daemon.metrics).

The dashboard is hand-kept JSON; a renamed metric would leave a panel silently empty. So every
`kvdata_*` name its PromQL uses must be a family the daemon renders (from a real Service over
temp tiers), rate()/increase() only ever apply to counters, and gauges are never rated. The
escaping rules of the text format are checked here too (render and escape_label). The live
endpoint, promtool and a real Prometheus evaluating these queries: tests/integration/test_metrics.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdata.config import parse_config
from kvdata_daemon.metrics import METRICS, escape_label, render
from kvdata_daemon.state import Service

DASHBOARD = Path(__file__).resolve().parents[2] / "daemon" / "grafana-dashboard.json"
NAME = re.compile(r"\bkvdata_[a-zA-Z0-9_]+")
RATED = re.compile(r"\b(rate|irate|increase)\s*\(\s*(kvdata_[a-zA-Z0-9_]+)")


def exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, panels nested in rows included."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


@pytest.fixture
def exposition(tmp_path: Path) -> Iterator[dict[str, str]]:
    """{family name: type} from render() over a real Service's status (no socket)."""
    cfg = parse_config({"tiers": [{"name": "ram", "path": str(tmp_path / "ram"), "budget": "1MB"},
                                  {"name": "ssd", "path": str(tmp_path / "ssd"), "budget": "2MB"}]})
    svc = Service(cfg)
    try:
        text = render(svc.status(), started=svc.started)
    finally:
        svc.close()
    yield {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def test_dashboard_is_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 30
    assert dash["title"] and dash["uid"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 5
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for want in ("tier use", "hit rate", "staging throughput", "queue", "stall"):
        assert want in titles, f"no panel about {want!r}"
    for p in dash["panels"]:  # every query goes to the datasource the user picks, none hard-wired
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= names


def test_every_metric_the_dashboard_queries_is_exported(exposition: dict[str, str]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for title, expr in exprs(dash):
        found = NAME.findall(expr)
        assert found, f"panel {title!r}: {expr!r} queries no kvdata metric"
        used.update(found)
        for name in found:
            assert name in exposition, f"panel {title!r} queries {name}, which kvdatad does not export"
        for _fn, name in RATED.findall(expr):
            assert exposition[name] == "counter", f"panel {title!r} takes the rate of gauge {name}"
        for name in found:  # a counter's raw value is meaningless on a graph (it only grows)
            if exposition[name] == "counter":
                assert re.search(rf"\b(rate|irate|increase)\s*\(\s*{name}\b", expr), f"panel {title!r}: raw counter {name}"
    templ = " ".join(json.dumps(v.get("query", "")) for v in dash["templating"]["list"])
    used.update(n for n in NAME.findall(templ) if n in exposition or pytest.fail(f"template queries {n}"))
    for want in ("kvdata_tier_used_bytes", "kvdata_tier_budget_bytes", "kvdata_hits_total", "kvdata_misses_total",
                 "kvdata_staged_bytes_total", "kvdata_staging_in_flight", "kvdata_reader_stall_seconds_total"):
        assert want in used, f"the dashboard does not show {want}"


def test_exposition_declares_every_family_by_convention(exposition: dict[str, str]) -> None:
    assert set(exposition) == {m.name for m in METRICS}
    for m in METRICS:
        assert m.name.startswith("kvdata_") and re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", m.name), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert m.kind in ("counter", "gauge") and m.help and "\n" not in m.help
        if re.search(r"second|byte", m.name):  # base units, as the suffix (before _total)
            assert re.search(r"_(seconds|bytes)(_total)?$", m.name), m.name


def test_label_values_and_help_are_escaped() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    st = {"tiers": [{"name": 'nv"me\\1\nx', "used": 1, "budget": 2, "shards": 0, "problem": None}],
          "clients": [], "datasets": [{"key": "00ff", "mode": "random", "bytes": 10, "resident_budget": 5,
                                       "resident_bytes": 4, "resident_shards": 1, "resident_staged": 1}],
          "in_flight": 4, "workers": 3, "hits": 1, "misses": 0}
    text = render(st, started=1.0, version='1.0"x')
    assert 'kvdata_tier_budget_bytes{tier="nv\\"me\\\\1\\nx"} 2\n' in text
    assert 'kvdata_build_info{version="1.0\\"x"} 1\n' in text
    assert "kvdata_staging_queued 1\n" in text
    assert 'kvdata_dataset_resident_bytes{dataset="00ff"} 4\n' in text
    assert all(line.startswith("#") or "\n" not in line for line in text.splitlines())


def test_docs_table_lists_every_metric() -> None:
    doc = (DASHBOARD.parents[1] / "docs" / "DAEMON.md").read_text()
    section = doc[doc.index("## Metrics"):]
    rows = re.findall(r"^\| `(kvdata_\w+)` \| (\w+) \|", section, re.M)
    assert rows == [(m.name, m.kind) for m in METRICS], "docs/DAEMON.md's metrics table differs from METRICS"
