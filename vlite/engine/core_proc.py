"""EngineCoreProc: the engine core's busy loop in its own process, talking over ZeroMQ.

The API process does tokenization, detokenization and HTTP; this process only schedules and runs
the model, so the two overlap. Loop: drain the input socket (block only while idle), step, send
the step's outputs with fresh scheduler stats.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import traceback
from typing import Any

import zmq

from vlite.engine.arg_utils import EngineArgs
from vlite.engine.core_messages import (EngineCoreOutputs, EngineCoreRequestType, EngineReady, UtilityCall,
                                        decode_request, encode, request_id_of)
from vlite.core.sched.output import EngineCoreOutput
from vlite.executor import ExecutorDeadError
from vlite.request import FinishReason, RequestStatus

logger = logging.getLogger("vlite.engine_core")

_IDLE_POLL_MS = 200


class EngineCoreProc:
    UTILITY_METHODS = ("reset_prefix_cache", "get_stats", "ping", "add_lora", "remove_lora", "list_loras", "pin_lora")

    def __init__(self, engine_args: EngineArgs, input_addr: str, output_addr: str) -> None:
        self.ctx = zmq.Context()
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_addr)
        try:
            from vlite.engine.core import EngineCore  # torch and the model: this process only

            loaded = engine_args.create_engine_config()
            self.engine_core = EngineCore(loaded)
        except Exception as e:  # report load failures to the API process, then exit
            self._send(EngineCoreOutputs(engine_error=f"engine failed to start: {e}"))
            raise
        # This process holds one engine for its life: what start-up made is moved out of the garbage collector's
        # sight (as vLLM's engine core does), so its oldest-generation passes stop walking ~200k long-lived objects
        # (measured: ~100 ms each, inside a request's step).
        gc.collect()
        gc.freeze()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_addr)
        self.parent_pid = os.getppid()
        self.running = True
        sched = loaded.config.scheduler_config
        self._send(EngineCoreOutputs(ready=EngineReady(
            max_model_len=sched.max_model_len, vocab_size=loaded.arch.vocab_size,
            kv_capacity_tokens=loaded.kv_capacity_tokens, num_kv_blocks=loaded.num_kv_blocks,
            eos_token_ids=list(loaded.eos_token_ids), model_name=loaded.resolved.name, pid=os.getpid(),
            runner="generate" if loaded.pooler_config is None else "pooling", pooler_config=loaded.pooler_config,
            hidden_size=loaded.arch.hidden_size, max_prompt_tokens=None if sched.enable_chunked_prefill
            else sched.max_num_batched_tokens)))

    def _send(self, msg: EngineCoreOutputs) -> None:
        self.output_socket.send(encode(msg), copy=False)

    def run_busy_loop(self) -> None:
        core = self.engine_core
        while self.running:
            handled = self._process_input_queue(block=not core.has_unfinished_requests())
            if not self.running:
                break
            if os.getppid() != self.parent_pid:
                logger.warning("API process is gone; engine core exits")
                break
            core.executor.check_health()  # a worker that died while idle ends the engine core too
            if core.has_unfinished_requests():
                self._step()
            elif handled:
                self._send(EngineCoreOutputs(stats=core.make_stats()))

    def _step(self) -> None:
        core = self.engine_core
        try:
            outputs = core.step()
        except ExecutorDeadError:
            raise  # run_engine_core reports it and exits: the API process fails every request
        except Exception as e:
            # Outside the model runner (a request failing there fails alone, see EngineCore.step):
            # fail what was in flight, keep serving from a clean batch and an empty prefix cache.
            logger.error("engine step failed: %s", traceback.format_exc())
            ids = list(core.scheduler.requests)
            core.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            core.executor.reset()
            core.reset_prefix_cache()
            self._send(EngineCoreOutputs(stats=core.make_stats(),
                                         failed_requests={i: f"engine step failed: {e}" for i in ids}))
            return
        self._send(EngineCoreOutputs(outputs=outputs, stats=core.make_stats()))

    def _process_input_queue(self, block: bool) -> bool:
        """Handle every queued input; wait for the first one only when `block` (idle)."""
        handled = False
        timeout = _IDLE_POLL_MS if block else 0
        while self.input_socket.poll(timeout):
            kind_frame, payload = self.input_socket.recv_multipart()
            self._handle(EngineCoreRequestType(kind_frame), payload)
            handled = True
            timeout = 0
            if not self.running:
                break
        return handled

    def _handle(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        core = self.engine_core
        if kind == EngineCoreRequestType.SHUTDOWN:
            self.running = False
            return
        try:
            msg = decode_request(kind, payload)
        except Exception as e:  # what cannot be read here fails alone (its request, where it names one)
            rid = request_id_of(payload) if kind == EngineCoreRequestType.ADD else None
            logger.error("vlite: the engine core could not read a %s message (%s)", kind.name, e)
            if rid is not None:
                self._send(EngineCoreOutputs(failed_requests={rid: f"the engine core could not read the request: {e}"}))
            return
        if kind == EngineCoreRequestType.ADD:
            try:
                core.add_request(msg)
            except ValueError as e:  # the request's own fault (a duplicate id, a bad adapter): a 400, it alone
                self._send(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    request_id=msg.request_id, new_token_ids=[], finish_reason=str(FinishReason.ERROR), error=str(e),
                    bad_request=True)]))
            except ExecutorDeadError:
                raise
            except Exception as e:  # fail that request alone
                self._send(EngineCoreOutputs(failed_requests={msg.request_id: str(e)}))
        elif kind == EngineCoreRequestType.ABORT:
            core.abort_requests(msg)
        elif kind == EngineCoreRequestType.UTILITY:
            try:
                reply = EngineCoreOutputs(utility_call_id=msg.call_id, utility_result=self._utility(msg))
            except Exception as e:  # e.g. add_lora of a bad folder: the caller's error; the engine serves on
                logger.warning("utility call %s failed: %s", msg.method, e)
                reply = EngineCoreOutputs(utility_call_id=msg.call_id, utility_error=str(e),
                                          utility_bad_request=isinstance(e, ValueError))
                if isinstance(e, ExecutorDeadError):
                    self._send(reply)
                    raise
            self._send(reply)

    def _utility(self, call: UtilityCall) -> Any:
        core = self.engine_core
        if call.method == "reset_prefix_cache":
            return core.reset_prefix_cache()
        if call.method == "get_stats":
            from dataclasses import asdict

            return asdict(core.make_stats())
        if call.method == "ping":
            return True
        if call.method == "add_lora":
            import msgspec

            from vlite.lora.request import LoRARequest

            return core.add_lora(msgspec.convert(call.args[0], LoRARequest))
        if call.method in ("remove_lora", "pin_lora"):
            return getattr(core, call.method)(int(call.args[0]))
        if call.method == "list_loras":
            return sorted(core.list_loras())
        return None

    def close(self) -> None:
        core = getattr(self, "engine_core", None)
        if core is not None:
            core.shutdown()
        for sock in (getattr(self, "input_socket", None), self.output_socket):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()


def run_engine_core(engine_args: EngineArgs, input_addr: str, output_addr: str, log_level: int) -> None:
    """Process entry point."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(message)s")
    # The API process owns shutdown: ignore Ctrl-C aimed at the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    proc = None
    try:
        proc = EngineCoreProc(engine_args, input_addr, output_addr)
        proc.run_busy_loop()
    except ExecutorDeadError as e:
        logger.error("model workers failed: %s", e)
        if proc is not None:  # tell the API process why before exiting: it fails every request, /health 503
            proc._send(EngineCoreOutputs(engine_error=f"model worker failed: {e}"))
        raise SystemExit(1)
    except Exception:
        logger.error("engine core died: %s", traceback.format_exc())
        raise SystemExit(1)
    finally:
        if proc is not None:
            proc.close()
