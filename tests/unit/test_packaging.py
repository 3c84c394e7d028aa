"""What users install is ranges; what this project installs is locked; the two agree.

pyproject.toml is what a user's resolver sees (ranges: their own torch and numpy are kept);
locks/*.txt are this project's own environments (made by locks/lock.sh). A lock that misses a
requirement, or a lowest-versions lock that is not at the lower bounds, would make CI prove
something other than what users get.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "locks" / name).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_no_requirement_a_user_installs_is_pinned_to_one_release() -> None:
    reqs = list(PROJECT["dependencies"])
    for extra, items in PROJECT["optional-dependencies"].items():
        reqs += [f"{r}  (extra {extra})" for r in items]
    pinned = [r for r in reqs if "==" in r.split(";")[0]]  # (a marker may compare with ==)
    assert not pinned, f"pinned for users: {pinned}; pin this project's own environments in locks/ instead"


def test_every_core_dependency_has_a_lower_bound() -> None:
    for req in PROJECT["dependencies"]:
        assert ">=" in req, f"{req}: give the oldest release kvdata supports (proven by .ci/lowest-versions)"


def test_the_lowest_lock_holds_each_core_dependency_at_its_lower_bound() -> None:
    lowest = _lock("lowest.txt")
    for req in PROJECT["dependencies"]:
        name = _name(req)
        bound = re.search(r">=\s*([0-9][^,;\s]*)", req)
        assert bound is not None
        want = bound.group(1)
        got = lowest.get(name)
        assert got is not None, f"{name} is missing from locks/lowest.txt: rerun bash locks/lock.sh"
        assert [int(x) for x in got.split(".")] == [int(x) for x in want.split(".")] + [0] * (
            len(got.split(".")) - len(want.split("."))), f"{name}: locks/lowest.txt has {got}, pyproject says >={want}"


def test_the_test_lock_covers_every_requirement_of_the_test_and_dev_extras() -> None:
    lock = _lock("test.txt")
    extras = PROJECT["optional-dependencies"]
    for req in list(PROJECT["dependencies"]) + extras["test"] + extras["dev"]:
        if ";" in req and "platform_machine" in req:
            continue  # isal: a marker this lock's platform (x86_64) satisfies; checked below
        assert _name(req) in lock, f"{_name(req)} is not in locks/test.txt: rerun bash locks/lock.sh"
    assert "isal" in lock
    assert lock["torch"].split("+")[0] == "2.13.0", "the project's environments hold the CPU build of torch 2.13.0"


def test_the_readme_test_command_installs_from_the_lock() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests\n", 1)[1]
    command = re.search(r"```bash\n(.*?)\n", section).group(1)  # type: ignore[union-attr]
    assert "-c locks/test.txt" in command, command
