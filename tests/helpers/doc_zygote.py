"""A Python that has imported what a document's python blocks import, and forks once per block
(tests/helpers/doc_blocks.py): each block still runs in a process of its own, as a script
(`__name__ == "__main__"`, its own cwd, environment, argv and stdout/stderr), without paying
torch's, Lightning's or transformers' import again (3-9 s of CPU each).

    python doc_zygote.py MODULE...     (with the environment the blocks run in)

It imports the MODULEs (one that fails is left for the block to import, and fail, itself),
prints "ready", then reads one JSON request per line on stdin, {"script", "cwd", "env", "log"},
forks a child that runs the script in a session of its own, and answers {"pid": N} at once and
{"exit": CODE} when the child is gone (CODE as a shell says it: 128 + N after signal N).
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def _child(req: dict) -> None:
    os.setsid()
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req["script"]
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        import runpy

        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- reported as a script's uncaught exception is
        import traceback

        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main() -> None:
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001,S110 -- the block imports it again and reports the error itself
            pass
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.write(json.dumps({"exit": code if code >= 0 else 128 - code}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
