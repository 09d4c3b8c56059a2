"""A model worker: one tensor-parallel rank, in a process of the `mp` executor
(vlite.executor.multiproc_executor) or in a Ray actor of the `ray` executor (vlite.executor.ray_executor).

It joins the torch.distributed group, loads its shard of the weights as the checkpoint is read (no
process holds the whole model), builds a ModelRunner over that shard and then runs what the
executor sends: each message is pickled once by the executor and read here as bytes.

    ("execute_model", SchedulerOutput)     no reply (an error is kept for the next sample_tokens)
    ("sample_tokens", GrammarOutput|None)  reply ("ok", ModelRunnerOutput on rank 0 / its KVConnectorOutput or
                                           None on the others) or ("error", text)
    ("reset", None)                        reply ("ok", None)
    ("add_lora", LoRARequest)              reply ("ok", bool) or ("error", the exception: see _portable)
    ("remove_lora" | "pin_lora", int)      the same
    ("list_loras", None)                   reply ("ok", set[int]) or ("error", ...)
    ("shutdown", None)                     exit
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from vlite.config import LoadedEngineConfig

logger = logging.getLogger("vlite.worker")

_PARENT_POLL_S = 0.5
LORA_METHODS = ("add_lora", "remove_lora", "list_loras", "pin_lora")


def load_shard(loaded: LoadedEngineConfig, rank: int, world_size: int) -> LoadedEngineConfig:
    """`loaded` with this rank's part of the config and of the weights, read one tensor at a time."""
    from vlite.model_arch import expected_weight_names
    from vlite.model_loader import iter_model_weights
    from vlite.model_loader.tp_shard import plan_tp, shard_arch, shard_weight

    _, tensors = iter_model_weights(loaded.resolved, loaded.torch_dtype)
    arch = loaded.arch
    if world_size == 1:
        return dataclasses.replace(loaded, weights=dict(tensors))
    shard = plan_tp(arch, world_size)[rank]
    from vlite.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp is not None:
        tp.shard = shard
    weights = {name: shard_weight(name, w, arch, shard) for name, w in tensors}
    missing = sorted(expected_weight_names(arch) - weights.keys())
    if missing:
        raise ValueError(f"{loaded.resolved.name}: missing tensors {missing[:5]}")
    return dataclasses.replace(loaded, arch=shard_arch(arch, shard), weights=weights)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors the model holds (parameters, packed and tiled weights); not the
    rotary tables, which are no weights (and every rank keeps whole)."""
    import torch

    from vlite.layers.packed import PackedTensors, TiledTensors
    from vlite.layers.rotary_embedding import RotaryEmbedding

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(t, (PackedTensors, TiledTensors)):
            for f in dataclasses.fields(t):
                add(getattr(t, f.name))

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        for value in vars(module).values():
            add(value)
        for p in module.parameters(recurse=False):
            add(p)
        for b in module.buffers(recurse=False):
            add(b)
    return sum(seen.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the engine core dies, however it dies (no orphan ranks)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Worker:
    """One rank: joins the group, loads its shard, runs what the executor sends (`handle`)."""

    def __init__(self, rank: int, world_size: int, init_method: str, loaded: LoadedEngineConfig) -> None:
        import torch

        from vlite.distributed.parallel_state import init_tp_group
        from vlite.worker.model_runner import ModelRunner

        if loaded.config.device_config.num_threads is None and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # the ranks share the cores
        # (--threads: ModelRunner.from_loaded sets each rank's own)
        # Unseeded sampling (rank 0 draws) from the engine's seed, as in one process: a forked worker
        # inherits its parent's generator, a spawned one would start from torch's default.
        torch.manual_seed(loaded.config.model_config.seed)
        self.rank = rank
        if world_size > 1:
            init_tp_group(rank, world_size, init_method)
        self.runner = ModelRunner.from_loaded(load_shard(loaded, rank, world_size))
        self._pending_error: Optional[str] = None

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "weight_bytes": weight_bytes(self.runner.model),
                "rss_bytes": _rss_bytes()}

    def handle(self, method: str, arg: Any) -> Optional[tuple[str, Any]]:
        """The reply to one message, or None (execute_model: its error waits for sample_tokens)."""
        runner = self.runner
        if method == "execute_model":
            try:
                runner.execute_model(arg)
            except Exception as e:
                self._pending_error = f"{type(e).__name__}: {e}"
                logger.error("rank %d: execute_model raised: %s", self.rank, traceback.format_exc())
            return None
        if method == "sample_tokens":
            if self._pending_error is not None:
                reply, self._pending_error = ("error", self._pending_error), None
                return reply
            try:
                out = runner.sample_tokens(arg)
                # the other ranks: only their KV-connector report (merged by the executor), if any
                return ("ok", out if self.rank == 0 else out.kv_connector_output)
            except Exception as e:
                logger.error("rank %d: sample_tokens raised: %s", self.rank, traceback.format_exc())
                return ("error", f"{type(e).__name__}: {e}")
        if method == "reset":
            runner.reset()
            self._pending_error = None
            return ("ok", None)
        if method == "stats":
            return ("ok", self.info())
        if method in LORA_METHODS:
            try:
                fn = getattr(runner, method)
                return ("ok", fn() if method == "list_loras" else fn(arg))
            except Exception as e:  # e.g. a bad adapter folder: the caller's error, this rank serves on
                logger.warning("rank %d: %s refused: %s", self.rank, method, e)
                return ("error", _portable(e))
        return ("error", f"unknown worker method {method!r}")

    def close(self) -> None:
        from vlite.distributed.parallel_state import destroy_tp_group

        self.runner.shutdown_kv_connector()
        destroy_tp_group()


def _portable(e: Exception) -> Exception:
    """The exception itself where it survives pickling (the executor raises it to the caller as it is), else
    a ValueError (for a ValueError) or RuntimeError with its message."""
    try:
        copy = pickle.loads(pickle.dumps(e))
        if type(copy) is type(e) and str(copy) == str(e):
            return e
    except Exception:
        pass
    return ValueError(str(e)) if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")


def run_worker(rank: int, world_size: int, init_method: str, loaded: LoadedEngineConfig, conn: Connection,
               parent_pid: int, log_level: int, inherited_fds: Sequence[int] = ()) -> None:
    """Process entry point of one rank of the `mp` executor, forked or spawned alike. `inherited_fds`
    (forked): the executor's ends of the ranks' pipes, which this process must not hold (its copies of
    the Connection objects stay unused in the frames the fork copied)."""
    _die_with_parent()
    for fd in inherited_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    # force: a forked worker drops the handlers it inherited, as a spawned one has none
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(message)s",
                        force=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process owns shutdown
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if os.getppid() != parent_pid:
        return
    try:
        worker = Worker(rank, world_size, init_method, loaded)
    except Exception as e:
        logger.error("rank %d failed to start: %s", rank, traceback.format_exc())
        conn.send_bytes(pickle.dumps(("error", f"rank {rank} failed to start: {type(e).__name__}: {e}")))
        return
    conn.send_bytes(pickle.dumps(("ok", worker.info())))
    try:
        _serve(worker, conn, parent_pid)
    finally:
        worker.close()


def _serve(worker: Worker, conn: Connection, parent_pid: int) -> None:
    while True:
        if not conn.poll(_PARENT_POLL_S):
            if os.getppid() != parent_pid:
                return
            continue
        try:
            method, arg = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if method == "shutdown":
            return
        reply = worker.handle(method, arg)
        if reply is not None:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
