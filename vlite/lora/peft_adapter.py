"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) read into vlite's fused layout.

Only what vlite can apply is accepted, and anything else is refused at load with the adapter's path and the
reason: plain LoRA (no DoRA, no biases, no fan_in_fan_out, no modules_to_save, one rank and alpha for all
modules) on the decoder layers' attention and dense MLP projections (vlite.lora.layout.module_specs), rank
at most max_lora_rank, every A/B shape that of the base model's layer. `target_modules` ("all-linear", a
regex string or a list) is not trusted alone: the modules applied are those the tensors hold.

The scaling (lora_alpha / r; rsLoRA: lora_alpha / sqrt(r)) is folded into B, so a module's update is
x @ A.T @ B.T.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from vlite.layers import weight_arena
from vlite.lora.layout import ModuleSpec, module_specs
from vlite.model_arch import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's key of a decoder layer's LoRA matrix, as save_pretrained writes it (the adapter's name removed).
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json options that change what LoRA computes, with the value vlite requires (a false-ish one).
_UNSUPPORTED_OPTIONS = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases",
                        "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
                        "alpha_pattern": "per-module alphas (alpha_pattern)",
                        "trainable_token_indices": "trainable tokens", "layer_replication": "layer_replication"}


class LoRAAdapterError(ValueError):
    """An adapter vlite cannot apply to the model; the message names the adapter's folder and the reason."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"LoRA adapter {path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self) -> tuple:
        """Pickled with its two arguments: a worker process sends it to the engine core as it is."""
        return (type(self), (self.path, self.reason))


@dataclass(frozen=True)
class LoRAWeights:
    """One checkpoint module's update: out[:, out_offset:out_offset + n] += x @ lora_a.T @ lora_b.T."""

    module: str  # "q_proj", ...
    index: int  # its place among its projection's modules (q, k, v: 0, 1, 2): its rank block in a slot
    out_offset: int  # first row of the module in vlite's fused projection
    lora_a: torch.Tensor  # [r, in_features]
    lora_b: torch.Tensor  # [n, r], the scaling folded in (a view of B transposed: lora_b.t() is contiguous)


@dataclass(frozen=True)
class LoRAModel:
    """A loaded adapter: per decoder layer, per fused projection ("qkv", "o", "gate_up", "down"), the updates of
    the modules it covers (a projection the adapter does not touch is absent)."""

    path: str
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA (already in every lora_b)
    modules: tuple[str, ...]  # the checkpoint modules the tensors hold, sorted: ("k_proj", "q_proj", ...)
    layers: tuple[dict[str, tuple[LoRAWeights, ...]], ...]  # [layer][projection] -> its modules' updates

    def fill_slot(self, layer: int, projection: str, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  max_rank: int) -> None:
        """Write this adapter into one slot of a projection's stacked weights (lora_a [R, K], lora_b [N, R]:
        vlite.lora.layout.empty_slots indexed by slot). Module j's A goes to rows [j * max_rank, ...) of A,
        its B to its output rows and the same rank columns of B; zeros elsewhere (a module or projection
        the adapter leaves alone, ranks below max_rank)."""
        lora_a.zero_()
        lora_b.zero_()
        for w in self.layers[layer].get(projection, ()):
            r0, r = w.index * max_rank, w.lora_a.shape[0]
            lora_a[r0:r0 + r].copy_(w.lora_a)
            lora_b[w.out_offset:w.out_offset + w.lora_b.shape[0], r0:r0 + r].copy_(w.lora_b)

    def num_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for ws in layer.values() for w in ws
                   for t in (w.lora_a, w.lora_b))


# A tensor-parallel rank's part of one of an adapter's matrices: (layer, module, "A" or "B", tensor) -> tensor
ShardFn = Callable[[int, ModuleSpec, str, torch.Tensor], torch.Tensor]


def load_peft_adapter(path: str | Path, cfg: ModelArchConfig, max_lora_rank: int,
                      dtype: torch.dtype = torch.float32, shard: Optional[ShardFn] = None) -> LoRAModel:
    """Read and check a PEFT LoRA folder for a model of `cfg`; LoRAAdapterError says what is wrong.

    `shard`: under tensor parallelism, cuts each matrix to the rank's part (`cfg` is then the rank's config,
    whose shapes the cut matrices must have). Each lora_b is held transposed in memory ([r, n] contiguous, a
    view [n, r]): the expand step reads B's rank rows whole (vlite.lora.layers)."""
    folder = Path(path)
    config = _read_config(folder)
    rank, alpha = _rank_and_alpha(folder, config, max_lora_rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder)
    specs = module_specs(cfg)
    _check_targets(folder, config.get("target_modules"), specs)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        layer, spec, which = _parse_key(folder, key, cfg, specs)
        pairs.setdefault((layer, spec.name), {})[which] = t
    if not pairs:
        raise LoRAAdapterError(folder, f"{WEIGHTS_FILE} holds no LoRA weights")
    checked = []
    for (layer, name), ab in sorted(pairs.items()):
        spec = specs[name]
        where = f"layer {layer} {name}"
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(folder, f"{where} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"], ab["B"]
        if shard is not None:
            a, b = shard(layer, spec, "A", a), shard(layer, spec, "B", b)
        if tuple(a.shape) != (rank, spec.in_features) or tuple(b.shape) != (spec.out_features, rank):
            raise LoRAAdapterError(
                folder, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not match the base model "
                f"(expected ({rank}, {spec.in_features}) and ({spec.out_features}, {rank}))")
        checked.append((layer, spec, a, b))
    # One buffer holds every matrix (views into it), in 2 MiB pages like the base weights (a decode step reads the
    # whole adapter: 4 KiB pages cost a rank-16 adapter's single stream 0.83 -> 0.80x the base's speed), given back
    # to the system whole when the adapter is dropped (small tensors would stay in the allocator's heap).
    storage = weight_arena.own_buffer(sum(a.numel() + b.numel() for _, _, a, b in checked), dtype)
    layers: list[dict[str, list[LoRAWeights]]] = [{} for _ in range(cfg.num_hidden_layers)]
    offset = 0
    for layer, spec, a, b in checked:
        a_view = storage[offset:offset + a.numel()].view(a.shape)
        offset += a.numel()
        b_t = storage[offset:offset + b.numel()].view(b.shape[1], b.shape[0])
        offset += b.numel()
        a_view.copy_(a)
        b_t.copy_((b.float() * scaling).t())
        layers[layer].setdefault(spec.projection, []).append(LoRAWeights(spec.name, spec.index, spec.out_offset,
                                                                         a_view, b_t.t()))
    return LoRAModel(str(folder), rank, scaling, tuple(sorted({name for _, name in pairs})),
                     tuple({p: tuple(sorted(ws, key=lambda w: w.index)) for p, ws in layer.items()}
                           for layer in layers))


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(folder, f"{CONFIG_FILE} not found")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(folder, f"{CONFIG_FILE} is not valid JSON ({e})") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(folder, f"peft_type {config['peft_type']!r} is not supported (only LORA)")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise LoRAAdapterError(folder, f"{what} ({option}={config[option]!r}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(folder, f"bias={config['bias']!r} is not supported (only 'none')")
    return config


def _rank_and_alpha(folder: Path, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(folder, f"r must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(folder, f"rank {rank} exceeds max_lora_rank ({max_lora_rank})")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(folder, f"lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        other = " (adapter_model.bin is not read: convert it to safetensors)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise LoRAAdapterError(folder, f"{WEIGHTS_FILE} not found{other}")
    try:
        return load_file(file)
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(folder, f"{WEIGHTS_FILE} cannot be read ({e})") from e


def _check_targets(folder: Path, targets: Any, specs: dict[str, ModuleSpec]) -> None:
    """A list of target modules must name modules vlite applies; "all-linear" or a regex is checked through
    the tensors (the regex is PEFT's business: what it matched is what was saved)."""
    if isinstance(targets, (list, tuple)):
        for t in targets:
            name = str(t).rsplit(".", 1)[-1]
            if name not in specs:
                raise LoRAAdapterError(folder, f"target module {t!r} is not supported; vlite applies LoRA to "
                                       f"{', '.join(specs)}")


def _parse_key(folder: Path, key: str, cfg: ModelArchConfig, specs: dict[str, ModuleSpec]
               ) -> tuple[int, ModuleSpec, str]:
    """(layer, module, "A" or "B") of a tensor's key, or the refusal that names the module."""
    m = _KEY.fullmatch(key)
    if m is None:
        module = re.sub(r"(\.base_layer|\.lora_[^.]+)?(\.weight|\.bias)?$", "", key.removeprefix("base_model.model."))
        raise LoRAAdapterError(folder, f"module {module!r} ({key}) is not supported; vlite applies LoRA to the "
                               f"decoder layers' {', '.join(specs)}")
    layer, parent, name, which = int(m[1]), m[2], m[3], m[4]
    spec = specs.get(name)
    if spec is None or spec.parent != parent:
        raise LoRAAdapterError(folder, f"module {parent}.{name} ({key}) is not supported; vlite applies LoRA to "
                               f"{', '.join(specs)}")
    if layer >= cfg.num_hidden_layers:
        raise LoRAAdapterError(folder, f"{key}: layer {layer} does not exist (the base model has "
                               f"{cfg.num_hidden_layers})")
    if parent == "mlp" and layer in cfg.moe_layers:
        raise LoRAAdapterError(folder, f"{key}: layer {layer} is a mixture of experts, which LoRA cannot target yet")
    return layer, spec, which
