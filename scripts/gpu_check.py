"""The GPU check of issue 14, run once on the device machine (an H200) in about 8 minutes.

Prepare here (CPU machine):   bash scripts/gpu_wheels.sh          (wheels the device image lacks -> .whl/)
Run there (the device tool):  run(command="python3 -m pip install -q --no-index --no-deps --no-compile
                                  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export
                                  PYTHONPATH=/tmp/site:$PWD || exit; PYTHONUNBUFFERED=1 python3
                                  scripts/gpu_check.py", carry=[".whl"], timeout_s=560)

Stages (each under its own timeout, so a stuck one still leaves the others' results):

  1. kernels   the Triton kernel and backend tests on the GPU (not the interpreter), device inputs
  2. parity    tiny-model parity tests (Llama, Gemma 2, Mistral, Qwen3) with vlite on device="auto" (the
               GPU) in float32 and transformers on the same GPU (VLITE_TEST_DEVICE=cuda), near-tie rule;
               bf16 agreement (teacher-forced top-1) of a tiny Llama
  3. graphs    CUDA graphs on vs off: the same greedy tokens (float32, 24 requests, SmolLM2-135M shape)
  4. bench     `vlite bench throughput` / `latency` for the default model's shape (SmolLM2-135M: on a GPU its
               GGUF is dequantized to dense bf16, so random weights of its shape run the same kernels) and a
               Llama-3-8B-shaped model with random weights, with the H200's limits beside them

Everything goes to $OUT: gpu_check.log (all output), results.json (every figure, one object per stage).
The default model's own file (94 MB) does not fit the device tool's 64 MiB carry, hence random weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's vlite and tests, not an installed copy
OUT = Path(os.environ.get("OUT", "/tmp/gpu_check_out"))
WORK = Path("/tmp/vlite_gpu_check")
H200_BW = 4.8e12  # bytes/s HBM3e
H200_BF16 = 989e12  # dense bf16 FLOP/s
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
               tie_word_embeddings=True, rms_norm_eps=1e-5)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False, rms_norm_eps=1e-5)
# GPU_CHECK_DRY=1: a rehearsal on the CPU (tiny shapes, no kernel/parity stages) that checks this script's
# own plumbing (model folders, tokenizers, bench invocations, results) before GPU minutes are spent on it.
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
if DRY:
    for _shape in (SMOLLM2, LLAMA3_8B):
        _shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
        _shape.update(num_attention_heads=4, num_key_value_heads=2 if _shape is LLAMA3_8B else 1)
BUDGET_S = 520  # the whole script; the device tool's call gets timeout_s=560
results: dict = {}
_log = None
_t0 = time.time()


def remaining() -> float:
    return BUDGET_S - (time.time() - _t0)


def log(*parts: object) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    _log.write(line + "\n")
    _log.flush()


def sh(name: str, cmd: list[str], timeout: int, env: dict | None = None) -> tuple[int, str]:
    """Run `cmd` from the repo root, its output into the log; (returncode, output); 124 on timeout."""
    timeout = int(min(timeout, remaining()))
    if timeout < 20:
        log(f"\n===== {name}: skipped, {remaining():.0f} s of the budget left")
        results.setdefault("stages", {})[name] = {"rc": "skipped"}
        return 125, ""
    log(f"\n===== {name}: {' '.join(cmd)} (timeout {timeout} s)")
    start = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    log(out.rstrip()[-20000:])
    log(f"===== {name}: rc={rc} in {time.time() - start:.0f} s")
    results.setdefault("stages", {})[name] = {"rc": rc, "seconds": round(time.time() - start, 1)}
    return rc, out


def random_llama(folder: Path, shape: dict) -> Path:
    """An HF Llama folder with random bf16 weights of `shape` (made on the GPU) and a word-level tokenizer
    of the full vocabulary (every id decodes)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02).cpu()

    w = {"model.embed_tokens.weight": rand(shape["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not shape["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(shape["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
              p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
              p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
              p + "mlp.down_proj.weight": rand(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=hd, bos_token_id=1,
                  eos_token_id=2, torch_dtype="bfloat16", hidden_act="silu")
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(folder)
    return folder


def limits(shape: dict) -> dict:
    """The H200's bounds for a model of `shape` in bf16: decode at batch 1 reads every weight once per token
    (memory bandwidth), prefill does 2 FLOPs per weight per token (bf16 tensor cores)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    per_layer = h * (shape["num_attention_heads"] * hd * 2 + shape["num_key_value_heads"] * hd * 2) + 3 * h * inter
    params = layers * per_layer + shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    matmul_params = params - (0 if shape["tie_word_embeddings"] else shape["vocab_size"] * h)  # embedding: a gather
    return {"params": params, "weight_bytes_bf16": 2 * params,
            "decode_bs1_tokens_per_s_bound": H200_BW / (2 * params),
            "prefill_tokens_per_s_bound": H200_BF16 / (2 * matmul_params)}


def graphs_on_off(model: Path) -> None:
    """Greedy float32 tokens with CUDA graphs and with --enforce-eager: identical, or parted right after a
    near-tie of the eager run (top-2 logprob gap < 1e-3: padded GEMM shapes may round differently)."""
    import random

    from vlite import LLM, SamplingParams

    rng = random.Random(0)
    n = 4 if DRY else 24
    prompts = [[rng.randrange(3, SMOLLM2["vocab_size"]) for _ in range(rng.randint(1, 200))] for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    runs = {}
    for eager in (False, True):
        llm = LLM(model=str(model), device=DEVICE, dtype="float32", enforce_eager=eager, max_num_seqs=32,
                  kv_cache_memory_bytes=4 * 2**30)
        runs[eager] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
        graphs = llm.llm_engine.engine_core.model_runner.cuda_graphs
        log(f"enforce_eager={eager}: graph replays {graphs.num_replays if graphs else 'none (eager)'}")
        if not eager:
            results["graphs"] = {"replays": graphs.num_replays if graphs else 0}
        del llm
    same, near_tie, bad = 0, 0, []
    for i, (g, e) in enumerate(zip(runs[False], runs[True])):
        if g.token_ids == e.token_ids:
            same += 1
            continue
        j = next(k for k, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b)
        lps = sorted((lp.logprob for lp in e.logprobs[j].values()), reverse=True)
        gap = lps[0] - lps[1] if len(lps) > 1 else float("inf")
        if gap < 1e-3:
            near_tie += 1
        else:
            bad.append((i, j, gap))
    results["graphs"] |= {"identical": same, "parted_at_near_tie": near_tie, "parted_otherwise": bad}
    log("graphs on/off:", results["graphs"])


def bf16_agreement() -> None:
    """vlite in bf16 on the GPU against transformers' float32 greedy continuations (tiny Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models import tiny
    from vlite import LLM

    hf = tiny.build(LlamaConfig, LlamaForCausalLM, seed=5)
    tok = tiny.tiny_tokenizer()
    folder = tiny.save_hf(hf, tok, WORK / "tiny-llama")
    prompts = tiny.prompts(tok)
    refs = tiny.references(hf, prompts)
    llm = LLM(model=str(folder), device=DEVICE, dtype="bfloat16", kv_cache_memory_bytes=2**30)
    top1, median_gap, max_gap = tiny.teacher_forced_agreement(llm, prompts, refs)
    results["bf16_agreement"] = {"top1": top1, "median_logprob_gap": median_gap, "max_logprob_gap": max_gap}
    log("bf16 agreement (tiny Llama, teacher-forced):", results["bf16_agreement"])


def bench(name: str, model: Path, shape: dict, eager_latency: bool) -> None:
    """`vlite bench throughput` and `latency` (batch 1, and batch 32) on `model`; JSON into results."""
    figures = results.setdefault("bench", {}).setdefault(name, {"h200_limits": limits(shape)})
    runs = {"throughput": ["throughput", "--num-prompts", "256", "--input-len", "512", "--output-len", "128"],
            "latency_bs1": ["latency", "--batch-size", "1", "--input-len", "128", "--output-len", "128",
                            "--num-iters", "3"],
            "latency_bs32": ["latency", "--batch-size", "32", "--input-len", "128", "--output-len", "128",
                             "--num-iters", "3"]}
    if DRY:
        runs = {k: [a if not a.isdigit() or a == "1" else "4" for a in v] for k, v in runs.items()}
    if eager_latency:
        runs["latency_bs1_eager"] = runs["latency_bs1"] + ["--enforce-eager"]
    for run, args in runs.items():
        path = WORK / f"{name}-{run}.json"
        rc, _ = sh(f"bench {name} {run}", [sys.executable, "-m", "vlite", "bench", *args, "--model", str(model),
                                           "--device", DEVICE, "--output-json", str(path)],
                timeout=150)
        figures[run] = json.loads(path.read_text()) if rc == 0 and path.exists() else {"rc": rc}


def stage(name: str, fn, *args, need_s: float = 30) -> None:
    if remaining() < need_s:
        log(f"\n===== {name}: skipped, {remaining():.0f} s of the budget left (needs ~{need_s:.0f})")
        results.setdefault("stages", {})[name] = {"rc": "skipped"}
        return
    log(f"\n===== {name}")
    start = time.time()
    try:
        fn(*args)
        rc = 0
    except Exception as e:  # one stage failing must not cost the others' results
        import traceback

        log(traceback.format_exc())
        results.setdefault("errors", {})[name] = repr(e)
        rc = 1
    results.setdefault("stages", {})[name] = {"rc": rc, "seconds": round(time.time() - start, 1)}
    log(f"===== {name}: rc={rc} in {time.time() - start:.0f} s")


def main() -> int:
    global _log
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    _log = open(OUT / "gpu_check.log", "w")
    os.environ.pop("TRITON_INTERPRET", None)
    sh("env", ["bash", "-c", f"nvidia-smi -L; {sys.executable} -c 'import torch, triton, transformers; "
               "print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)'"], 60)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--durations=5"]
    if DRY:  # the rehearsal: this script's own stages only
        stage("make smollm2-shaped model", random_llama, WORK / "smollm2-135m-shape", SMOLLM2)
        stage("graphs", graphs_on_off, WORK / "smollm2-135m-shape")
        stage("bench smollm2-135m-shape", bench, "smollm2-135m-shape", WORK / "smollm2-135m-shape", SMOLLM2, True)
        (OUT / "results.json").write_text(json.dumps(results, indent=1, default=str))
        log(json.dumps(results, indent=1, default=str)[-3000:])
        return 0
    sh("kernels", pytest + ["tests/attention/test_triton_reshape_and_cache.py",
                            "tests/attention/test_triton_unified_attention.py",
                            "tests/attention/test_triton_cascade.py",
                            "tests/attention/test_triton_attn_backend.py", "tests/worker",
                            "tests/test_config_device.py"],
       timeout=120)
    sh("parity", pytest[:-1] + ["-s", "tests/models/test_llama.py", "tests/models/test_gemma2.py",
                                "tests/models/test_mistral.py", "tests/models/test_qwen3.py",
                                "-k", "not int8"],  # int8/int4 are CPU kernels: refused on CUDA
       timeout=180, env={"VLITE_TEST_DEVICE": "cuda"})
    stage("bf16_agreement", bf16_agreement)
    small = WORK / "smollm2-135m-shape"
    stage("make smollm2-shaped model", random_llama, small, SMOLLM2)
    stage("graphs", graphs_on_off, small)
    stage("bench smollm2-135m-shape", bench, "smollm2-135m-shape", small, SMOLLM2, True)
    big = WORK / "llama3-8b-shape"
    stage("make llama3-8b-shaped model", random_llama, big, LLAMA3_8B, need_s=150)
    if (big / "model.safetensors").exists():
        stage("bench llama3-8b-shape", bench, "llama3-8b-shape", big, LLAMA3_8B, False, need_s=60)
    results["total_seconds"] = round(time.time() - _t0, 1)
    (OUT / "results.json").write_text(json.dumps(results, indent=1, default=str))
    log(json.dumps(results, indent=1, default=str)[-6000:])
    return 0 if all(s["rc"] in (0, "skipped") for s in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
