"""The CUDA-graph runner's padding, on the CPU: a graph stands in for torch.cuda.CUDAGraph by running the
captured call again on the static buffers (what a replay does), with the Triton backend under the
interpreter. A decode step of 3 requests replayed at padded size 4 must give the eager step's hidden
states and KV caches: the padded row writes no K/V (slot -1) and attends to nothing (seq_len 0)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.models import tiny
from vlite.layers.quantization import QuantizationPlan
from vlite.model_loader import load_model_weights, resolve_model
from vlite.models.registry import build_model
from vlite.worker.cuda_graphs import CUDAGraphRunner

BS, MAX_BLOCKS = 16, 4


class _ReplayAgain:
    """torch.cuda.CUDAGraph's contract without CUDA: replay() recomputes into the captured output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def test_padded_replay_matches_eager(tmp_path: Path, triton_device) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlite.attention.backends.triton_attn import TritonAttentionBackend as backend

    hf = tiny.build(LlamaConfig, LlamaForCausalLM, seed=7)
    hf.save_pretrained(tmp_path)
    arch, weights = load_model_weights(resolve_model(str(tmp_path)), torch.float32)
    model = build_model(arch, weights, QuantizationPlan(None), torch.float32)
    shape = backend.get_kv_cache_shape(12, BS, arch.num_key_value_heads, arch.head_dim)
    caches = {k: [torch.zeros(shape) for _ in range(arch.num_hidden_layers)] for k in ("eager", "graph")}
    gen = torch.Generator().manual_seed(0)
    prompts = [(0, 20, [3, 9]), (0, 5, [1]), (0, 33, [0, 4, 6])]
    decode = [(20, 1, [3, 9]), (5, 1, [1]), (33, 1, [0, 4, 6])]

    def step(reqs, kv):
        a = tiny.step_inputs(reqs, BS, MAX_BLOCKS)
        md = backend.build_metadata(a["query_start_loc"], a["seq_lens"], a["block_table"], a["slot_mapping"], BS,
                                    arch.attention_windows, max(n for _, n, _ in reqs))
        return a, md

    ids = torch.randint(0, tiny.VOCAB_SIZE, (58,), generator=gen)
    with torch.inference_mode():
        for kv in caches.values():  # the prompts, eagerly, into both caches
            a, md = step(prompts, kv)
            model(ids, a["positions"], kv, md)
        next_ids = torch.randint(0, tiny.VOCAB_SIZE, (3,), generator=gen)
        a, md = step(decode, caches["eager"])
        want = model(next_ids, a["positions"], caches["eager"], md)

        graphs = CUDAGraphRunner(model, caches["graph"], backend, BS, arch.attention_windows, max_num_seqs=6,
                                 max_blocks_per_req=MAX_BLOCKS, device=torch.device("cpu"))
        assert graphs.sizes == [1, 2, 4, 6] and graphs.padded_size(3, 3) == 4 and graphs.padded_size(3, 4) is None
        graphs.input_ids.fill_(5)  # stale values in the padded row must not matter
        graphs.positions.fill_(40)
        graphs.block_table.fill_(2)
        graphs.slot_mapping.fill_(2 * BS + 8)  # a previous step's slot: block 2, which no request holds
        graphs.seq_lens.fill_(41)
        for size in graphs.sizes:  # what capture() records, without CUDA
            args = (graphs.input_ids[:size], graphs.positions[:size], graphs.kv_caches, graphs._metadata[size])
            g = _ReplayAgain(functools.partial(model, *args), torch.empty(size, arch.hidden_size))
            graphs._graphs[size] = (g, g.out)
        got = graphs.run(4, next_ids, a["positions"], md.slot_mapping, md.seq_lens, md.block_table)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.num_replays == 1
    for x, y in zip(caches["eager"], caches["graph"]):
        # The same K/V up to rounding (projections of 4 rows instead of 3), and block 2, which no request holds
        # but the padded row's stale table points at, still empty: the padded row wrote nothing.
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
        assert not y[:, :, 2].any()
