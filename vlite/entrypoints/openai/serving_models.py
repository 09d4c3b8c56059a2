"""The models a server answers to (vLLM's OpenAIServingModels): its base model names and the LoRA adapters
registered on it, each adapter a model of its own (`model: "<adapter>"` runs a request under it).

Adapters come from `--lora-modules` (loaded at start-up: a bad one fails start-up) and, where the operator
allows it with VLLM_ALLOW_RUNTIME_LORA_UPDATING, from POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's routes, status codes and messages). The engine loads and validates an adapter's folder
(engine.add_lora); this registry gives each name its engine id and resolves a request's `model` to it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from vlite.engine.core_client import EngineDeadError
from vlite.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vlite.entrypoints.openai.serving_engine import OpenAIError
from vlite.lora.request import LoRARequest

logger = logging.getLogger("vlite")

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """vLLM's switch for the load/unload routes: "1" or "true" (any case); off by default, since loading
    a folder named by a client reads the server's disk."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's): the adapter's name, its PEFT folder, and optionally the served
    base model /v1/models lists as its parent."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; raises ValueError
    saying what is wrong with `item`."""
    text = item.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON {item!r}: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"expected a JSON object, got {item!r}")
        known = {f.name for f in fields(LoRAModulePath)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown} in {item!r} (expected name, path, base_model_name)")
        missing = [k for k in ("name", "path") if not isinstance(spec.get(k), str) or not spec[k].strip()]
        if missing:
            raise ValueError(f"{' and '.join(missing)} must be non-empty strings in {item!r}")
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"base_model_name must be a string in {item!r}")
        return LoRAModulePath(spec["name"].strip(), spec["path"].strip(), base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip() or "=" in path:
        raise ValueError(f"expected name=path or a JSON object, got {item!r}")
    return LoRAModulePath(name.strip(), path.strip())


def parse_lora_modules(items: Sequence[str]) -> list[LoRAModulePath]:
    """Every entry parsed; two adapters of one name are an error (the name is how requests pick one)."""
    modules = [parse_lora_module(item) for item in items if item.strip()]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"adapter name {m.name!r} is given twice")
        seen.add(m.name)
    return modules


def check_lora_modules(modules: Sequence[LoRAModulePath], served_model_names: list[str]) -> None:
    """What can be said of the --lora-modules without the model (a ValueError naming the adapter): its name
    must not be a served model's, its base_model_name must be one."""
    for m in modules:
        if m.name in served_model_names:
            raise ValueError(f"--lora-modules: adapter name {m.name!r} is also a served model name")
        if m.base_model_name is not None and m.base_model_name not in served_model_names:
            raise ValueError(f"--lora-modules: adapter {m.name!r}: base_model_name {m.base_model_name!r} is not a "
                             f"served model name ({', '.join(served_model_names)})")


class OpenAIServingModels:
    """The served base model names and the registered adapters; resolves a request's `model`.

    Each adapter gets a fresh lora_int_id (1, 2, ...; never reused, so an id the engine may still hold for an
    unloaded adapter never names another one). Registry changes happen under one asyncio lock; resolving a
    request's model reads the registry without it (a dict lookup, never half-updated).
    """

    def __init__(self, engine: Any, served_model_names: list[str],
                 lora_modules: Optional[Sequence[LoRAModulePath]] = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}
        self._parents: dict[str, str] = {}  # adapter name -> the base model id /v1/models lists as its parent
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def init_static_loras(self) -> None:
        """Load the `--lora-modules` adapters; raises ValueError naming the first that fails and why."""
        for m in self.static_lora_modules:
            try:
                await self.load_lora_adapter(m.name, m.path, m.base_model_name)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules: {e.message}") from None

    def resolve(self, model: Optional[str]) -> tuple[str, Optional[LoRARequest]]:
        """The name a response echoes and the adapter a request runs under (None: the base model).

        No `model`, or any served name, is the base model under its first name (as vLLM); an unknown name
        is vLLM's 404.
        """
        if model is None or model in self.served_model_names:
            return self.served_model_names[0], None
        lora = self.lora_requests.get(model)
        if lora is not None:
            return lora.lora_name, lora
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def show_available_models(self, root: str, max_model_len: int) -> dict[str, Any]:
        """/v1/models: the base model under each served name, then each adapter (vLLM's ModelCard: `root` its
        folder, `parent` its base model)."""
        created = int(time.time())
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "vlite", "root": root,
                  "parent": None, "max_model_len": max_model_len} for name in self.served_model_names]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "vlite", "root": lora.lora_path,
                   "parent": self._parents[name], "max_model_len": None} for name, lora in self.lora_requests.items()]
        return {"object": "list", "data": cards}

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: Optional[str] = None) -> str:
        """Register an adapter and have the engine load (and so validate) it; its success message (vLLM's).

        A 400 for a missing field, a taken name, or an adapter the engine refuses (the engine's reason, which
        names the folder); nothing is registered then.
        """
        if not lora_name or not lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", 400,
                              "lora_path" if lora_name else "lora_name")
        async with self._lock:
            if lora_name in self.lora_requests:
                raise OpenAIError(f"The lora adapter '{lora_name}' has already been loaded.", 400, "lora_name")
            if lora_name in self.served_model_names:
                raise OpenAIError(f"The lora adapter name '{lora_name}' is a served model name; pick another",
                                  400, "lora_name")
            if base_model_name is not None and base_model_name not in self.served_model_names:
                raise OpenAIError(f"The lora adapter '{lora_name}': base_model_name '{base_model_name}' is not a "
                                  f"served model (served: {', '.join(self.served_model_names)})", 400,
                                  "base_model_name")
            lora = LoRARequest(lora_name, next(self._ids), lora_path)
            try:
                await self.engine.add_lora(lora)
            except (EngineDeadError, asyncio.CancelledError):
                raise
            except Exception as e:  # LoRAAdapterError, a missing folder, LoRA not enabled: the request's problem
                where = "" if lora_path in str(e) else f" (from {lora_path})"
                raise OpenAIError(f"Failed to load LoRA adapter '{lora_name}'{where}: {e}", 400,
                                  "lora_path") from None
            self.lora_requests[lora_name] = lora
            self._parents[lora_name] = base_model_name or self.served_model_names[0]
        logger.info("loaded LoRA adapter %r (id %d) from %s", lora_name, lora.lora_int_id, lora_path)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: Optional[str] = None, lora_int_id: Optional[int] = None) -> str:
        """Unregister an adapter (by name, or by its lora_int_id) and free it in the engine; vLLM's 404 when
        there is no such adapter. Requests already running under it finish under it (the engine's concern)."""
        if not lora_name and lora_int_id is None:
            raise OpenAIError("either 'lora_name' or 'lora_int_id' needs to be provided.", 400, "lora_name")
        async with self._lock:
            lora = self.lora_requests.get(lora_name) if lora_name else next(
                (r for r in self.lora_requests.values() if r.lora_int_id == lora_int_id), None)
            if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
                label = lora_name if lora_name else f"with lora_int_id {lora_int_id}"
                raise OpenAIError(f"The lora adapter '{label}' cannot be found.", 404,
                                  "lora_name" if lora_name else "lora_int_id")
            # Unregistered first: a request arriving meanwhile gets the 404, not an adapter being freed.
            del self.lora_requests[lora.lora_name]
            del self._parents[lora.lora_name]
            try:
                await self.engine.remove_lora(lora.lora_int_id)
            except EngineDeadError:
                raise
            except Exception as e:  # as vLLM: the name is gone either way; the engine evicts it later
                logger.warning("removing LoRA adapter %r (id %d) from the engine failed: %s", lora.lora_name,
                               lora.lora_int_id, e)
        logger.info("unloaded LoRA adapter %r (id %d)", lora.lora_name, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."


def add_lora_routes(app: FastAPI, get_models: Callable[[], OpenAIServingModels]) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): 200 with a plain-text message, errors
    in OpenAI's shape. Only added when runtime_lora_updating_allowed(); otherwise the paths are 404s."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await get_models().load_lora_adapter(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await get_models().unload_lora_adapter(body.lora_name, body.lora_int_id))
