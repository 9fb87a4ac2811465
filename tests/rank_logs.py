"""Where the ranks of tests/dist_utils.py write their logs, reading them back, and the report a
killed test session leaves behind (see [Note: what a failed or hung task reports] there)."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

DUMP_WAIT_S = 3.0  # at most this long for ranks to write their stacks after a signal
LOG_TAIL_CHARS = 6000  # of each failed rank's log, in an error

_dir: str | None = None
_kept = False


def log_dir() -> str:
    """``DTENSOR_FP8_TEST_LOG_DIR`` (kept after the session) or a temporary folder (removed by
    :func:`cleanup`)."""
    global _dir, _kept
    if _dir is None:
        _kept = bool(os.environ.get("DTENSOR_FP8_TEST_LOG_DIR"))
        _dir = os.environ.get("DTENSOR_FP8_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="dtensor_fp8_ranks_")
        os.makedirs(_dir, exist_ok=True)
    return _dir


def cleanup() -> None:
    global _dir
    if _dir is not None and not _kept:
        shutil.rmtree(_dir, ignore_errors=True)
        _dir = None


def tail(path: str, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of a log."""
    try:
        with open(path, "rb") as f:
            f.seek(0, io.SEEK_END)
            n = f.tell()
            f.seek(max(0, n - chars))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return ("..." if n > chars else "") + text


def size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def await_growth(sizes: dict[str, int], limit: float = DUMP_WAIT_S) -> None:
    """Wait until every log in ``sizes`` (path -> size before the signal) has grown and then stayed
    the same for 0.2 s (a stack dump written), at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    last = dict(sizes)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = {path: size(path) for path in sizes}
        if all(now[p] > sizes[p] and now[p] == last[p] for p in sizes):
            return
        last = now


def install_sigterm_report(live_pools, config=None) -> None:
    """On SIGTERM (e.g. ``timeout`` killing pytest): this process's stacks, every live rank's stacks
    (the ranks write theirs on SIGTERM or SIGUSR1) and the tails of their logs, written to
    ``sigterm-<pid>.txt`` in the log folder and to stderr (past pytest's output capture, given
    pytest's ``config``); the pools killed; then pytest stopped as Ctrl-C does (it still prints
    what ran and what failed).

    Args:
        live_pools: a collection of the pools whose ranks may be running (``RankPool`` objects).
        config: pytest's config, or ``None``.

    Example:
        >>> install_sigterm_report(dist_utils.LIVE_POOLS, config)  # in pytest_configure
    """

    def on_term(signum, frame):
        # `timeout` sends SIGTERM twice (to pytest, then to its process group): the second must not
        # cut this report short. What follows a stuck report is `timeout -k`'s SIGKILL.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pools = list(live_pools)
        path = os.path.join(log_dir(), f"sigterm-{os.getpid()}.txt")
        with open(path, "w") as out:
            out.write("[rank_logs] SIGTERM: stacks of the test process, then of every live rank\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            before = {log: size(log) for pool in pools for log in pool.logs}
            signalled = [pool.logs[r] for pool in pools for r in pool.dump_stacks(wait=False)]
            if signalled:
                await_growth({log: before[log] for log in signalled})
            for pool in pools:
                out.write(f"--- pool {pool.name} (pids {pool.pids}, {pool.runs} runs) ---\n")
                for log in pool.logs:
                    out.write(f"--- {log} (tail) ---\n{tail(log, 3000)}\n")
        for pool in pools:
            pool.close(kill=True)
        capman = config.pluginmanager.getplugin("capturemanager") if config is not None else None
        with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
            with open(path) as f:
                sys.stderr.write(f.read())
            sys.stderr.flush()
        raise KeyboardInterrupt(f"SIGTERM (report: {path})")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
