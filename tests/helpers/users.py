"""Other uids for the attacker tests (tests/integration/test_daemon_trust.py).

As root, `make_user(suffix)` creates a system user once (`useradd --system --no-create-home`,
reused when present). `as_user(user, fn, *args)` runs `fn` in a forked child that has
dropped to that uid and gid (no supplementary groups) -- the kernel then reports that uid
to kvdatad through SO_PEERCRED -- and returns what it returned (or raises what it raised,
as RemoteFailure with the child's traceback). A fork rather than `setpriv ... python`:
the interpreter may live under a directory the test user cannot enter (/root/.pyenv), and
everything the child needs is imported by the parent first.
"""

from __future__ import annotations

import os
import pickle
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "kvdtest_"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


class RemoteFailure(AssertionError):
    """What `fn` raised in the child, with its traceback in the message."""


def can_switch_users() -> str | None:
    """None if this process can create and become other users; else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (to create test users and drop to their uids)"
    if shutil.which("useradd") is None:
        return "useradd is not installed"
    return None


def make_user(suffix: str) -> User:
    """A system user named kvdtest_<suffix>, created if missing (idempotent)."""
    name = PREFIX + suffix
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           capture_output=True, text=True)
        if r.returncode != 0 and "already exists" not in r.stderr:
            raise RuntimeError(f"useradd {name} failed: {r.stderr.strip()}") from None
        pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


def give(path: Path, user: User, mode: int | None = None) -> Path:
    """chown -R path to user (and chmod the top directory when mode is given)."""
    for dirpath, dirnames, filenames in os.walk(path):
        os.chown(dirpath, user.uid, user.gid)
        for n in dirnames + filenames:
            os.chown(os.path.join(dirpath, n), user.uid, user.gid, follow_symlinks=False)
    if mode is not None:
        os.chmod(path, mode)
    return path


def as_user(user: User, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
            timeout: float = 60.0) -> Any:
    """fn(*args) in a child running as `user`; its return value (picklable) or RemoteFailure."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
            for k, v in (env or {}).items():
                os.environ[k] = v
            try:
                out: tuple[str, Any] = ("ok", fn(*args))
            except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
                out = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            data = pickle.dumps(out)
            with os.fdopen(w, "wb") as f:
                f.write(data)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"{fn.__name__} as {user.name} did not finish within {timeout:.0f} s")
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    if not chunks:
        raise RemoteFailure(f"{fn.__name__} as {user.name}: the child died without an answer")
    status, value = pickle.loads(b"".join(chunks))
    if status == "err":
        raise RemoteFailure(f"{fn.__name__} as {user.name} raised {value}")
    return value


def _blocked_for_this_uid(paths: list[str]) -> str | None:
    """(Run as the test user.) The first path this uid cannot use, with why; None if all can be."""
    for p in paths:
        mode = os.X_OK if os.path.isfile(p) else os.R_OK | os.X_OK
        if not os.access(p, mode):
            return p
    return None


def cannot_exec_python_as(user: User) -> str | None:
    """Why `user` cannot start this interpreter and import kvdata in a new process (for a skip
    reason), or None when it can. A venv under a 0700 home (a pyenv interpreter in /root, a
    clone in the user's home) is the usual cause: a forked child (as_user) still works there."""
    import kvdata

    interpreter = os.path.realpath(sys.executable)
    script = str(Path(sys.executable).parent / "kvdata")
    package = str(Path(kvdata.__file__).resolve().parent)
    paths = [interpreter, package] + ([script] if os.path.exists(script) else [])
    blocked = as_user(user, _blocked_for_this_uid, paths)
    if blocked is None:
        return None
    return (f"{user.name} cannot reach {blocked} (a parent directory is not searchable by other users, "
            f"e.g. a 0700 home): a new process as that uid cannot run this interpreter/kvdata")
