"""A file as users download them: a Llama-shaped GGUF quantized to Q4_K_M by llama.cpp's own llama-quantize
(`../shared/anchors/shaped_gguf.py OUT tiny`, then `llamacpp.sh quantize`), loaded through the file's memory
map: the weights are held once, at the file's size, the file's pages are given back, no quantized tensor
(the embedding included) has a float copy, and the process's peak RSS stays near file + KV pool.

Runs where the anchors and a built llama.cpp are on this machine (the anchors' scripts build it, ~7 min;
a test does not); elsewhere it skips (tests/models/test_llama.py loads a Q4_0 file through the map)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _anchors() -> Path | None:
    for d in (os.environ.get("VLITE_ANCHORS_DIR"), REPO.parent / "shared" / "anchors", "/work/shared/anchors"):
        if d and (Path(d) / "shaped_gguf.py").exists() and (Path(d) / "llamacpp.sh").exists():
            return Path(d)
    return None


def _llama_quantize_built() -> bool:
    root = os.environ.get("LLAMACPP_DIR") or os.path.expanduser("~/.cache/vlite-anchors/llama-cpp-python-*")
    return bool(glob.glob(os.path.join(root, "build", "bin", "llama-quantize")))


# Run in a fresh process, so that its RSS is the load's: the engine, one short generation, then what holds
# the weights. `baseline`: RSS after importing vlite/torch/transformers and reading the tokenizer once.
PROBE = r"""
import json, re, sys
import torch
from vlite import LLM, SamplingParams
from vlite.model_loader import load_tokenizer, resolve_model

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

path = sys.argv[1]
load_tokenizer(resolve_model(path))
baseline = status("VmRSS")
llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=16 * 2**20)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
runner = llm.llm_engine.engine_core.model_runner
held = {}  # every tiled weight once (a tied head and the embedding share theirs)
largest_float = ("", 0)
for name, module in runner.model.named_modules():
    for attr in ("tiled", "tiled_embed"):
        t = getattr(module, attr, None)
        if t is not None:
            held[id(t)] = sum(x.numel() * x.element_size() for x in (t.qt, t.scales, t.mins) if x is not None)
    tensors = list(module.named_parameters(recurse=False))  # (buffers: rotary tables, not weights)
    if isinstance(getattr(module, "dense", None), torch.Tensor):
        tensors.append(("dense", module.dense))
    for n, x in tensors:
        if x.is_floating_point() and x.numel() > largest_float[1]:
            largest_float = (f"{name}.{n}", x.numel())
file_rss = cache_rss = 0
smaps = open("/proc/self/smaps").read().split("\n")
current = None
for line in smaps:
    head = line.split()
    if head and re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
        current = head[5] if len(head) > 5 else None
    elif head and head[0] == "Rss:" and current == path:
        file_rss += int(head[1]) * 1024
    elif head and head[0] == "Rss:" and current and current.endswith("model.safetensors"):
        cache_rss += int(head[1]) * 1024
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "tiled": sum(held.values()), "file_rss": file_rss,
                  "cache_rss": cache_rss,
                  "largest_float": largest_float, "kv": sum(c.numel() * c.element_size() for c in runner.kv_caches),
                  "tokens": len(out[0].outputs[0].token_ids)}))
"""


@pytest.mark.slow
def test_q4_k_m_file_loads_through_the_map_once(tmp_path):
    anchors = _anchors()
    if anchors is None or not _llama_quantize_built():
        pytest.skip("needs ../shared/anchors (shaped_gguf.py, llamacpp.sh) and a built llama.cpp (llamacpp.sh build)")
    import gguf

    f16, q4km = tmp_path / "tiny-f16.gguf", tmp_path / "tiny-q4km.gguf"
    subprocess.run([sys.executable, str(anchors / "shaped_gguf.py"), str(f16), "tiny"], check=True,
                   capture_output=True)
    subprocess.run(["bash", str(anchors / "llamacpp.sh"), "quantize", str(f16), str(q4km), "Q4_K_M"], check=True,
                   capture_output=True)
    reader = gguf.GGUFReader(str(q4km))
    types = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q6_K"} <= types, types  # what Q4_K_M files hold
    quantized = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"))
    env = {**os.environ, "VLITE_CACHE_DIR": str(tmp_path / "cache")}
    for run in ("first", "cached"):
        probe = subprocess.run([sys.executable, "-c", PROBE, str(q4km)], check=True, capture_output=True, text=True,
                               env=env, cwd=REPO)
        got = json.loads(probe.stdout.strip().splitlines()[-1])
        assert got["tokens"] == 4
        # the weights once, at the file's size: tiles of 16 rows pad the few matrices whose rows are not a multiple
        assert quantized * 0.95 <= got["tiled"] <= quantized * 1.05, (run, got, quantized)
        assert got["file_rss"] <= 4 * 2**20, (run, got)  # the file's pages were given back after tiling
        # and so are those of the weights the cache holds (Q/K rows reordered for rotary; test_cache.py)
        assert got["cache_rss"] <= 2**20, (run, got)
        assert got["largest_float"][1] <= 256, (run, got["largest_float"])  # norms only: no float matrix
        size = q4km.stat().st_size
        # + the engine's own: its tokenizer, step buffers, Python objects (~100 MB here, whatever the file size)
        assert got["peak"] - got["baseline"] <= 1.15 * size + got["kv"] + 160 * 2**20, (run, got, size)
