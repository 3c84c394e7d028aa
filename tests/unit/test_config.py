"""kvdata.config: tiers and daemon settings from TOML (parse_config, load_config).

Tiers are listed fastest first, each with a name, a path and a budget (an int of bytes
or a size string: SI "256MB", binary "64MiB"); with no file the embedded default is one
tier under $XDG_CACHE_HOME/kvdata. Every bad value is a ConfigError whose message names
the setting (and the file) at fault.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdata.config import Config, TierConfig, config_path, default_config, load_config, parse_config
from kvdata.errors import ConfigError, KVDataError


def tiers(*rows: tuple[str, str, Any]) -> dict[str, Any]:
    return {"tiers": [{"name": n, "path": p, "budget": b} for n, p, b in rows]}


# ---------------------------------------------------------------- tiers and budgets


def test_tiers_in_order_with_size_strings() -> None:
    cfg = parse_config(tiers(("ram", "/dev/shm/kv", "8GiB"), ("ssd", "/var/cache/kv", "200GB"), ("hdd", "/d", 4096)))
    assert isinstance(cfg, Config)
    assert [t.name for t in cfg.tiers] == ["ram", "ssd", "hdd"]  # fastest first, as written
    assert cfg.tiers[0] == TierConfig("ram", Path("/dev/shm/kv"), 8 * 2**30)
    assert cfg.tiers[1].budget == 200 * 10**9
    assert cfg.tiers[2].budget == 4096
    assert cfg.stage_local is True and cfg.source is None


@pytest.mark.parametrize("text,want", [
    ("1", 1), ("512", 512), ("1B", 1), ("1k", 1000), ("1KB", 1000), ("256MB", 256 * 10**6), ("2gb", 2 * 10**9),
    ("1TB", 10**12), ("1KiB", 1024), ("64MiB", 64 << 20), ("8GiB", 8 << 30), ("1TiB", 1 << 40),
    (" 2 GiB ", 2 << 30), ("1.5MiB", 3 << 19), ("0.5GB", 5 * 10**8),
])
def test_budget_size_strings(text: str, want: int) -> None:
    assert parse_config(tiers(("t", "/x", text))).tiers[0].budget == want


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from(sorted(UNITS)), st.booleans())
def test_any_integer_with_any_unit(n: int, unit: str, lower: bool) -> None:
    text = f"{n}{unit.lower() if lower else unit}"
    assert parse_config(tiers(("t", "/x", text))).tiers[0].budget == n * UNITS[unit]


def test_tier_paths_expand_the_home_directory(hermetic_env: dict[str, Path]) -> None:
    cfg = parse_config(tiers(("ssd", "~/cache", "1GB")))
    assert cfg.tiers[0].path == hermetic_env["HOME"] / "cache"


def test_tier_lookup_by_name() -> None:
    cfg = parse_config(tiers(("ram", "/a", "1GB"), ("ssd", "/b", "2GB")))
    assert cfg.tier(None).name == "ram"  # the fastest
    assert cfg.tier("ssd").path == Path("/b")
    with pytest.raises(ConfigError, match=r"'nvme'.*ram, ssd"):
        cfg.tier("nvme")


def test_daemon_table() -> None:
    cfg = parse_config({**tiers(("ram", "/a", "1GB")),
                        "daemon": {"socket": "/run/x/kvdatad.sock", "group": "ml", "metrics_port": 9400}})
    assert cfg.daemon.socket == Path("/run/x/kvdatad.sock")
    assert cfg.daemon.group == "ml" and cfg.daemon.metrics_port == 9400
    plain = parse_config(tiers(("ram", "/a", "1GB")))
    assert plain.daemon.socket is None and plain.daemon.group is None and plain.daemon.metrics_port is None


# ---------------------------------------------------------------- bad values name the setting


@pytest.mark.parametrize("budget", ["lots", "12 parsecs", "-1", "0", "0MB", "", "1e9", "MB", "1.2.3GB"])
def test_bad_budget_string_names_the_tier_budget(budget: str) -> None:
    with pytest.raises(ConfigError, match=r"tier 'ssd' budget") as e:
        parse_config(tiers(("ram", "/a", "1GB"), ("ssd", "/b", budget)))
    assert repr(budget) in str(e.value)  # and the value


@pytest.mark.parametrize("budget", [0, -4096, True, False, None, ["1GB"], {"size": 1}, 1.5, 4096.0, "1.5", "2.5B"])
def test_bad_budget_value_names_the_tier_budget(budget: Any) -> None:
    with pytest.raises(ConfigError, match=r"tier 'ram' budget"):
        parse_config(tiers(("ram", "/a", budget)))


@settings(max_examples=100, deadline=None)
@given(st.integers(max_value=0))
def test_budget_must_be_positive(n: int) -> None:
    with pytest.raises(ConfigError, match="positive"):
        parse_config(tiers(("ram", "/a", n)))


@pytest.mark.parametrize("data,names", [
    ({}, ["[[tiers]]"]),
    ({"tiers": []}, ["[[tiers]]"]),
    ({"tiers": {"name": "ram"}}, ["[[tiers]]"]),
    ({"tiers": ["ram"]}, ["tiers[0]", "table"]),
    ({"tiers": [{"name": "ram", "path": "/a"}]}, ["tiers[0]", "budget"]),
    ({"tiers": [{"budget": "1GB"}]}, ["tiers[0]", "name", "path"]),
    (tiers(("ram", "/a", "1GB"), ("ram", "/b", "1GB")), ["'ram'", "unique"]),
    (tiers(("", "/a", "1GB")), ["''", "non-empty"]),
    (tiers(("a/b", "/a", "1GB")), ["'a/b'", "'/'"]),
    ({"tiers": [{"name": "ram", "path": "/a", "budget": "1GB", "speed": "fast"}]}, ["'ram'", "speed"]),
    ({**tiers(("ram", "/a", "1GB")), "daemon": "yes"}, ["[daemon]", "table"]),
    ({**tiers(("ram", "/a", "1GB")), "daemon": {"sockets": "/x"}}, ["[daemon]", "sockets"]),
    ({**tiers(("ram", "/a", "1GB")), "daemon": {"metrics_port": 0}}, ["metrics_port", "0"]),
    ({**tiers(("ram", "/a", "1GB")), "daemon": {"metrics_port": 70000}}, ["metrics_port", "70000"]),
    ({**tiers(("ram", "/a", "1GB")), "daemon": {"metrics_port": "9400"}}, ["metrics_port", "'9400'"]),
    ({**tiers(("ram", "/a", "1GB")), "daemon": {"metrics_port": True}}, ["metrics_port", "True"]),
    (tiers(("ram", "/a", 1.5)), ["tier 'ram' budget", "1.5"]),
    (tiers(("ram", "/a", "lots")), ["tier 'ram' budget", "'lots'"]),
], ids=["no-tiers", "empty-tiers", "tiers-not-a-list", "tier-not-a-table", "missing-budget", "missing-name-path",
        "duplicate-name", "empty-name", "slash-in-name", "unknown-tier-setting", "daemon-not-a-table",
        "unknown-daemon-setting", "port-zero", "port-too-big", "port-a-string", "port-a-bool", "budget-a-float",
        "budget-unreadable"])
def test_bad_config_names_the_setting(data: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(data, Path("/etc/kvdata.toml"))
    msg = str(e.value)
    assert "/etc/kvdata.toml" in msg, msg  # the file at fault
    for n in names:
        assert n in msg, f"{n!r} not named in: {msg}"
    assert "\n" not in msg


def test_config_error_is_a_kvdata_error_and_a_value_error() -> None:
    with pytest.raises(KVDataError):
        parse_config({})
    with pytest.raises(ValueError):
        parse_config({})


# ---------------------------------------------------------------- where the config comes from


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


TOML = '[[tiers]]\nname = "ssd"\npath = "/var/cache/kv"\nbudget = "2GiB"\n'


def test_config_path_rule(tmp_path: Path, hermetic_env: dict[str, Path]) -> None:
    assert config_path({"KVDATA_CONFIG": str(tmp_path / "k.toml")}) == tmp_path / "k.toml"
    assert config_path({"XDG_CONFIG_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "kvdata" / "kvdata.toml"
    assert config_path({}) == hermetic_env["HOME"] / ".config" / "kvdata" / "kvdata.toml"
    assert config_path() == hermetic_env["XDG_CONFIG_HOME"] / "kvdata" / "kvdata.toml"  # this process


def test_load_from_kvdata_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path / "elsewhere.toml", TOML)
    monkeypatch.setenv("KVDATA_CONFIG", str(p))
    cfg = load_config()
    assert cfg.source == p and cfg.tiers == (TierConfig("ssd", Path("/var/cache/kv"), 2 << 30),)


def test_load_from_an_explicit_path_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDATA_CONFIG", str(write(tmp_path / "env.toml", TOML.replace("ssd", "env"))))
    assert load_config(write(tmp_path / "arg.toml", TOML)).tiers[0].name == "ssd"


def test_load_from_xdg_config_home(hermetic_env: dict[str, Path]) -> None:
    p = write(hermetic_env["XDG_CONFIG_HOME"] / "kvdata" / "kvdata.toml", TOML)
    assert load_config().source == p


def test_load_from_home_without_xdg(hermetic_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME")
    p = write(hermetic_env["HOME"] / ".config" / "kvdata" / "kvdata.toml", TOML)
    assert load_config().source == p


def test_missing_kvdata_config_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("KVDATA_CONFIG", str(missing))
    with pytest.raises(ConfigError, match="KVDATA_CONFIG") as e:
        load_config()
    assert str(missing) in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "also-missing.toml")


@pytest.mark.parametrize("text", ["[[tiers]\nname = 1", "tiers = [", "\x00", 'name = "unterminated'])
def test_bad_toml_names_the_file(tmp_path: Path, text: str) -> None:
    p = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError, match="TOML") as e:
        load_config(p)
    assert str(p) in str(e.value)


def test_bad_value_in_a_file_names_the_setting(tmp_path: Path) -> None:
    p = write(tmp_path / "k.toml", TOML.replace('"2GiB"', '"2 gigs"'))
    with pytest.raises(ConfigError, match=r"tier 'ssd' budget.*'2 gigs'"):
        load_config(p)


def test_no_file_means_one_default_tier_in_the_cache_dir(hermetic_env: dict[str, Path]) -> None:
    cfg = load_config()
    assert cfg.source is None and cfg.stage_local is False  # local homes are read in place
    assert len(cfg.tiers) == 1
    (tier,) = cfg.tiers
    assert tier.path == hermetic_env["XDG_CACHE_HOME"] / "kvdata"
    assert tier.budget > 0
    assert not tier.path.exists(), "loading the default config creates nothing"


def test_default_budget_is_80_percent_of_the_free_space(tmp_path: Path) -> None:
    import shutil

    cfg = default_config({"XDG_CACHE_HOME": str(tmp_path)})
    free = shutil.disk_usage(tmp_path).free
    assert cfg.tiers[0].path == tmp_path / "kvdata"
    assert 0.75 * free <= cfg.tiers[0].budget <= 0.85 * free  # the disk is shared: free space moves a little


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"[a-z][a-z0-9_-]{0,11}", fullmatch=True), st.integers(1, 2**50)),
                min_size=1, max_size=5, unique_by=lambda t: t[0]))
def test_toml_round_trip(rows: list[tuple[str, int]]) -> None:
    """Whatever tiers a file lists come back in order with their paths and budgets."""
    text = "".join(f'[[tiers]]\nname = "{n}"\npath = "/t/{n}"\nbudget = {b}\n\n' for n, b in rows)
    cfg = parse_config(tomllib.loads(text))
    assert [(t.name, t.path, t.budget) for t in cfg.tiers] == [(n, Path(f"/t/{n}"), b) for n, b in rows]


def test_the_environment_of_this_test_is_hermetic(hermetic_env: dict[str, Path]) -> None:
    """Guards the autouse fixture of tests/conftest.py: nothing of the developer's is visible."""
    for var in ("KVDATA_CONFIG", "KVDATA_SOCKET", "NOTIFY_SOCKET"):
        assert var not in os.environ
    for var, d in hermetic_env.items():
        assert os.environ[var] == str(d) and d.is_dir()
    assert Path.home() == hermetic_env["HOME"]
    assert not config_path().exists()
