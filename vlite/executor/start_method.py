"""How the `mp` executor starts its worker processes: fork where that is safe, as vLLM does on Linux.

fork needs no `if __name__ == "__main__":` guard (the child does not re-run the user's script) and
starts faster (torch is already imported). It is safe only while this process runs no other thread:
a forked child has only the forking thread, so a lock another thread held stays held, and torch's
OpenMP pool (started by the first parallel torch operation) makes the child hang in its first
parallel region (libgomp). So, vLLM's VLLM_WORKER_MULTIPROC_METHOD convention:

    VLITE_WORKER_MULTIPROC_METHOD (or VLLM_WORKER_MULTIPROC_METHOD) = fork | spawn
    unset: fork on Linux, spawn elsewhere
    fork, but unsafe (another thread runs, CUDA is initialized): spawn, with a warning if fork was asked for

The only threads fork tolerates are OpenBLAS's idle pool (numpy starts it on import; OpenBLAS
stops and restarts it around a fork itself).

With spawn, a child re-runs the user's script as `__mp_main__` before it runs the worker: a script
that starts the engine at module level, without the guard, would start it again there.
`exit_if_bootstrapping` catches that in the child at the engine's entry (before any loading): the
child exits quietly with UNGUARDED_MAIN_EXIT, and the parent, seeing that exit code, raises the one
line `unguarded_main_message` writes.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import sys
import threading
from typing import Optional

logger = logging.getLogger("vlite")

ENV_VARS = ("VLITE_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD")
METHODS = ("fork", "spawn")
# A spawned vlite child that found itself inside its parent's script's module-level engine start
# (sysexits' EX_CONFIG: no crash, a usage error the parent reports).
UNGUARDED_MAIN_EXIT = 78
# The names of the processes vlite starts (the child learns its name before it re-runs the script).
PROCESS_PREFIX = "vlite-"


def requested_method() -> Optional[str]:
    """The start method the environment asks for (VLITE_ first), or None."""
    for var in ENV_VARS:
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value not in METHODS:
                raise ValueError(f"{var} must be one of {METHODS}, got {value!r}")
            return value
    return None


def _openblas_pool_threads() -> int:
    """Threads of OpenBLAS's pool in this process (its thread count less the caller's), 0 without it."""
    count = 0
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return 0
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("", "scipy_"):
            for suffix in ("", "64_"):
                fn = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
                if fn is not None:
                    count += max(0, int(fn()) - 1)
                    break
            else:
                continue
            break
    return count


def threads_started() -> Optional[str]:
    """Why this process is not single-threaded (for fork), or None if it is."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"this process runs other threads ({', '.join(sorted(others))})"
    try:
        native = len(os.listdir("/proc/self/task")) - 1
    except OSError:
        return None
    native -= _openblas_pool_threads()
    if native > 0:
        return (f"this process has started {native} native thread(s) (e.g. torch's OpenMP pool, after "
                f"a parallel torch operation)")
    return None


def fork_unsafe_reason() -> Optional[str]:
    """Why forking this process now would be unsafe, or None."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return "fork is not available on this platform"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized in this process"
    return threads_started()


def worker_start_method() -> tuple[str, Optional[str]]:
    """("fork", None), or ("spawn", why fork is not used)."""
    asked = requested_method()
    if asked == "spawn":
        return "spawn", f"{_asked_by()}=spawn"
    if asked is None and not sys.platform.startswith("linux"):
        return "spawn", f"fork is the default on Linux only (set {ENV_VARS[0]}=fork to ask for it)"
    why = fork_unsafe_reason()
    if why is None:
        return "fork", None
    if asked == "fork":
        logger.warning("vlite: %s=fork, but %s: the workers are started by spawn", _asked_by(), why)
    return "spawn", why


def _asked_by() -> str:
    return next(var for var in ENV_VARS if os.environ.get(var, "").strip())


def in_spawn_bootstrap() -> bool:
    """True while a spawned child re-runs its parent's main module (multiprocessing's preparation)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def exit_if_bootstrapping(what: str) -> None:
    """At the entry of something that starts processes (`what`, e.g. "LLM(tensor_parallel_size=2)"): in
    a spawned child still re-running the parent's script, stop before loading anything. A child vlite
    started exits quietly with UNGUARDED_MAIN_EXIT (its parent reports it, once); any other child
    (the user's own multiprocessing) says why itself."""
    if not in_spawn_bootstrap():
        return
    if multiprocessing.current_process().name.startswith(PROCESS_PREFIX):
        raise SystemExit(UNGUARDED_MAIN_EXIT)
    raise SystemExit(unguarded_main_message(what, None))


def unguarded_main_message(what: str, why: Optional[str]) -> str:
    """The one line for a script that starts `what` at module level where its children are spawned
    (`why`: why vlite's own processes are; None: in a child the user's multiprocessing spawned)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    script = f"the script {os.path.basename(main)}" if main else "this script"
    where = (f"and its processes must be started by spawn because {why}" if why is not None
             else "and a process started by spawn re-runs it")
    return f"vlite: {script} starts {what} at module level, {where}; put that code under `if __name__ == \"__main__\":`"
