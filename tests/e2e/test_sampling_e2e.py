"""Sampling and outputs on the real model (float32): logprobs and prompt logprobs against transformers,
seeded sampling, stop strings (also streamed), parallel sampling (n > 1) and the logits processors.

Two engines in all: the session's `llm_fp32` and one with a 16-token step budget (chunked prefill),
which also serves as the "second instance" for seeded reproducibility.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.e2e.prompts import corpus_ids
from tests.e2e.reference import ATOL, compare_greedy, compare_runs, hf_greedy
from vlite import LLM, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow

STORY_PROMPT = "Once upon a time"
SHORT_CHAT = "What is 2+2? Answer with just the number."  # the model answers "2 + 2 = 4" (8 tokens with EOS)


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def chunked_llm():
    """A second engine whose 16-token step budget chunks every prompt longer than 16 tokens."""
    return LLM(dtype="float32", max_num_batched_tokens=16, kv_cache_memory_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def story(llm_fp32):
    """The greedy continuation of STORY_PROMPT: (token ids, text, char offset where each token starts).

    ', the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling ...'
    """
    tok = llm_fp32.get_tokenizer()
    out = llm_fp32.generate(STORY_PROMPT, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    ids, text = out.token_ids, out.text
    offsets = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert offsets[-1] == len(text)
    assert all(text.startswith(tok.decode(ids[:k])) for k in range(0, len(ids) + 1, 7))
    return ids, text, offsets


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is log_softmax of transformers' float32 logits after ids[:p+1] (one forward)."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def rank_window(ref_row: torch.Tensor, token: int, tol: float = ATOL) -> tuple[int, int]:
    """1 + #(reference logprobs strictly greater than the token's), widened by `tol` for near-ties."""
    value = float(ref_row[token])
    return 1 + int((ref_row > value + tol).sum()), int((ref_row > value - tol).sum())


def check_position(entry: dict, ref_row: torch.Tensor, n: int, chosen: int) -> None:
    """One position's {token_id: Logprob} (top-n + the chosen token) against the reference row."""
    lo, hi = rank_window(ref_row, chosen)
    assert lo <= entry[chosen].rank <= hi, f"rank {entry[chosen].rank} of token {chosen}, expected [{lo}, {hi}]"
    for token_id, lp in entry.items():
        assert abs(lp.logprob - float(ref_row[token_id])) < ATOL, (token_id, lp.logprob, float(ref_row[token_id]))
    top = {tid: lp for tid, lp in entry.items() if tid != chosen or lp.rank <= n}
    assert len(top) == n and len(entry) == n + (entry[chosen].rank > n)
    assert sorted(lp.rank for lp in top.values()) == list(range(1, n + 1))
    if n == 0:
        return
    ref_values, ref_ids = torch.topk(ref_row, n + 1)
    for lp in top.values():
        assert abs(lp.logprob - float(ref_values[lp.rank - 1])) < ATOL
    if float(ref_values[n - 1] - ref_values[n]) > ATOL:  # no near-tie at the top-n boundary
        assert set(top) == set(ref_ids[:n].tolist())


def drain(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def assert_all_blocks_free(llm: LLM) -> None:
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"], m
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0, m


def chat_ids(tok, content: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------- 1. logprobs


def test_logprobs_match_transformers(llm_fp32, hf_model, hf_tokenizer):
    ids = corpus_ids(hf_tokenizer)
    greedy_prompt, sampled_prompt = ids[3000:3040], ids[6000:6025]
    max_new = 16
    greedy5 = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    greedy0 = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    sampled5 = SamplingParams(temperature=1.5, seed=5, max_tokens=max_new, ignore_eos=True, logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (greedy_prompt, greedy_prompt, sampled_prompt, sampled_prompt)]
    g5, g0, s5, none = (o.outputs[0] for o in llm_fp32.generate(prompts, [greedy5, greedy0, sampled5, plain],
                                                                  use_tqdm=False))

    # Greedy, logprobs=5: tokens and top-5 equal transformers' greedy loop (up to a near-tie divergence).
    ref = hf_greedy(hf_model, greedy_prompt, max_new)
    matched = compare_greedy(g5.token_ids, g5.logprobs, ref, ATOL)["matched"]
    assert matched >= max_new // 2
    assert len(g5.logprobs) == len(g5.token_ids) == max_new
    for i in range(matched):
        check_position(g5.logprobs[i], ref.logprobs[i], 5, g5.token_ids[i])
        assert g5.logprobs[i][g5.token_ids[i]].rank == 1
        assert g5.logprobs[i][g5.token_ids[i]].decoded_token == hf_tokenizer.decode([g5.token_ids[i]])
    assert g5.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for lp, t in zip(g5.logprobs, g5.token_ids)), abs=1e-5)

    # logprobs=0: only the sampled token, with the same logprob and rank.
    compare_runs(g5, g0)
    assert len(g0.logprobs) == len(g0.token_ids)
    for i, (entry, token) in enumerate(zip(g0.logprobs, g0.token_ids)):
        assert list(entry) == [token]
        if i < matched and token == g5.token_ids[i]:
            assert entry[token].logprob == pytest.approx(g5.logprobs[i][token].logprob, abs=ATOL)
            assert entry[token].rank == g5.logprobs[i][token].rank
    assert g0.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(g0.logprobs, g0.token_ids)),
                                                  abs=1e-5)

    # Sampled at temperature 1.5: logprobs are the model's raw ones (before temperature); check every
    # position against one transformers forward over prompt + output, ranks included.
    rows = hf_logprobs(hf_model, sampled_prompt + s5.token_ids)[len(sampled_prompt) - 1:-1]
    ranks = []
    for i, token in enumerate(s5.token_ids):
        check_position(s5.logprobs[i], rows[i], 5, token)
        ranks.append(s5.logprobs[i][token].rank)
    print(f"ranks of tokens sampled at temperature 1.5: {ranks}")
    assert max(ranks) > 1, "a temperature-1.5 sample of 16 tokens should pick a non-top token"
    assert s5.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(s5.logprobs, s5.token_ids)),
                                                  abs=1e-5)

    assert none.logprobs is None and none.cumulative_logprob is None
    assert_all_blocks_free(llm_fp32)


def check_prompt_logprobs(plp: list, prompt: list[int], rows: torch.Tensor, n: int) -> None:
    assert plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        check_position(plp[j], rows[j - 1], n, prompt[j])


def test_prompt_logprobs_also_when_chunked(llm_fp32, chunked_llm, hf_model, hf_tokenizer):
    prompt = corpus_ids(hf_tokenizer)[7000:7061]
    rows = hf_logprobs(hf_model, prompt)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)

    # Streamed through the chunking engine: the prompt logprobs arrive chunk by chunk.
    engine = chunked_llm.llm_engine
    engine.add_request("plp-stream", {"prompt_token_ids": prompt}, params)
    lengths = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.prompt_logprobs))
            final = out
    assert final.finished
    assert sorted(set(lengths)) == [17, 33, 49, 61], f"prompt logprob counts per step: {lengths}"
    check_prompt_logprobs(final.prompt_logprobs, prompt, rows, 3)

    # Twice in one batch: the second copy must not skip its prompt (no prefix-cache hit) and loses nothing.
    for llm in (chunked_llm, llm_fp32):
        for out in llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False):
            check_prompt_logprobs(out.prompt_logprobs, prompt, rows, 3)
        assert_all_blocks_free(llm)


def test_max_tokens_zero_scores_the_prompt_without_sampling(chunked_llm, hf_model, hf_tokenizer):
    """max_tokens=0 with prompt_logprobs (the server's echo + max_tokens=0): the prompt's logprobs,
    chunked or not, no token sampled, finish_reason "length", every block back in the pool."""
    long = corpus_ids(hf_tokenizer)[7100:7140]  # 40 tokens: three chunks of the 16-token budget
    prompts = [long, long[:1], long[5:21]]  # 21 = one whole chunk of 16
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)
    engine = chunked_llm.llm_engine
    before = chunked_llm.get_metrics()
    for i, p in enumerate(prompts):
        engine.add_request(f"score-{i}", {"prompt_token_ids": p}, params)
    outputs = drain(engine)
    for i, p in enumerate(prompts):
        final = outputs[f"score-{i}"][-1]
        assert final.finished and [o.finished for o in outputs[f"score-{i}"]].count(True) == 1
        completion = final.outputs[0]
        assert completion.token_ids == [] and completion.text == "" and completion.finish_reason == "length"
        check_prompt_logprobs(final.prompt_logprobs, p, hf_logprobs(hf_model, p), 2)
    after = chunked_llm.get_metrics()
    assert after["generation_tokens"] == before["generation_tokens"]
    assert_all_blocks_free(chunked_llm)


# ---------------------------------------------------------------------------------------------- 2. seeds


def test_seeded_sampling_is_reproducible(llm_fp32, chunked_llm, hf_tokenizer):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm_fp32.generate(STORY_PROMPT, seeded, use_tqdm=False)[0].outputs[0]
    assert len(alone.token_ids) == 24

    # A batch of 16 requests with different prompts and parameters; two copies of the seeded request.
    ids = corpus_ids(hf_tokenizer)
    prompts, params = [], []
    for i in range(16):
        prompts.append({"prompt_token_ids": ids[500 + 211 * i:500 + 211 * i + 5 + 6 * i]})
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True, logprobs=2))
        elif kind == 1:
            params.append(SamplingParams(temperature=1.0, max_tokens=8 + i, top_k=40))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=20, min_p=0.05, presence_penalty=0.5))
        else:
            params.append(SamplingParams(temperature=1.2, top_p=0.8, max_tokens=16, repetition_penalty=1.2))
    for i in (5, 11):
        prompts[i], params[i] = STORY_PROMPT, seeded
    batch = llm_fp32.generate(prompts, params, use_tqdm=False)
    for i in (5, 11):
        assert batch[i].outputs[0].token_ids == alone.token_ids, f"seeded request at batch index {i} differs"
        assert batch[i].outputs[0].text == alone.text

    # Another LLM instance (other step budget, other KV pool), and a second run on the first one.
    other = chunked_llm.generate(STORY_PROMPT, seeded, use_tqdm=False)[0].outputs[0]
    assert other.token_ids == alone.token_ids
    again = llm_fp32.generate(STORY_PROMPT, seeded, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == alone.token_ids

    # Other seeds: other samples.
    texts = {alone.text}
    for seed in (1235, 99):
        p = seeded.clone()
        p.seed = seed
        texts.add(llm_fp32.generate(STORY_PROMPT, p, use_tqdm=False)[0].outputs[0].text)
    assert len(texts) == 3
    assert_all_blocks_free(llm_fp32)


# ---------------------------------------------------------------------------------------------- 3. stop strings


def stop_cases(story) -> list[tuple[str, list[str], str, int]]:
    """(name, stop strings, the one that must win, char offset where it starts in the story text)."""
    ids, text, offsets = story
    cases = []
    # Spanning several tokens, starting and ending inside tokens: 'ova Haven was a th'.
    start, end = offsets[4] + 2, offsets[8] + 3
    cases.append(("multi-token", [text[start:end]], text[start:end], start))
    # At the very start of the output: ', the'.
    cases.append(("at-start", [text[:5]], text[:5], 0))
    # Overlaps that all complete inside one long token (so within one detokenizer update).
    t = next(k for k in range(3, len(ids)) if offsets[k + 1] - offsets[k] >= 9)  # ' metropolis'
    a = offsets[t]
    x, y = text[a + 1:a + 4], text[a + 3:a + 6]  # "ab" / "bc": share one char; x ends first
    cases.append(("ab-bc", [y, x], x, a + 1))
    z, w = text[a - 4:a + 7], text[a + 2:a + 5]  # z starts first but ends last: w wins
    cases.append(("inner-ends-first", [z, w], w, a + 2))
    u, v = text[a + 1:a + 6], text[a + 3:a + 6]  # same end: the one starting first (cuts more) wins
    cases.append(("same-end", [v, u], u, a + 1))
    for name, stops, winner, pos in cases:
        assert text.find(winner) == pos
        for s in stops:
            assert text.find(s) + len(s) >= pos + len(winner), f"{name}: {s!r} completes before {winner!r}"
    return cases


def tokens_to_cover(offsets: list[int], end: int) -> int:
    """How many tokens the model must emit before the text reaches `end` chars."""
    return next(k for k, off in enumerate(offsets) if off >= end)


def test_stop_strings(llm_fp32, story):
    ids, text, offsets = story
    cases = stop_cases(story)
    prompts, params, expected = [], [], []
    for name, stops, winner, pos in cases:
        for include in (False, True):
            prompts.append(STORY_PROMPT)
            params.append(SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=stops,
                                         include_stop_str_in_output=include))
            end = pos + len(winner)
            expected.append((name, include, winner, text[:end] if include else text[:pos],
                             ids[:tokens_to_cover(offsets, end)]))
    # min_tokens also holds off stop strings (as in vLLM): ' the' first ends within token 2, then after token 10.
    min_tokens, stop = 10, " the"
    pos = text.find(stop, offsets[min_tokens] - len(stop) + 1)
    assert 0 < text.find(stop) < offsets[min_tokens] < pos
    prompts.append(STORY_PROMPT)
    params.append(SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop], min_tokens=min_tokens))
    expected.append(("min_tokens", False, stop, text[:pos], ids[:tokens_to_cover(offsets, pos + len(stop))]))
    outputs = llm_fp32.generate(prompts, params, use_tqdm=False)
    for out, (name, include, winner, want_text, want_ids) in zip(outputs, expected):
        c = out.outputs[0]
        assert c.text == want_text, (name, include)
        assert c.finish_reason == "stop" and c.stop_reason == winner, (name, include, c.stop_reason)
        assert c.token_ids == want_ids, (name, include)
    assert outputs[2].outputs[0].text == "" and outputs[3].outputs[0].text == text[:5]  # at-start
    assert_all_blocks_free(llm_fp32)


def test_stop_strings_streamed(llm_fp32, story):
    ids, text, offsets = story
    engine = llm_fp32.llm_engine
    name, stops, winner, pos = stop_cases(story)[0]  # multi-token

    # Alone: the request's blocks are freed in the very step that finds the stop string.
    gen_before = llm_fp32.get_metrics()["generation_tokens"]
    engine.add_request("stop-alone", STORY_PROMPT, SamplingParams(
        temperature=0, max_tokens=400, ignore_eos=True, stop=stops, output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        deltas += [o.outputs[0].text for o in outs]
        if outs and outs[-1].finished:
            assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == winner
            assert_all_blocks_free(llm_fp32)
            assert not engine.has_unfinished_requests()
    assert "".join(deltas) == text[:pos]
    # The engine core stopped with the output processor (no tokens generated past the stop string).
    assert llm_fp32.get_metrics()["generation_tokens"] - gen_before == tokens_to_cover(offsets, pos + len(winner))

    # Every case, both include modes, streamed together: deltas only ever extend the final text.
    finals = {}
    for i, (name, stops, winner, pos) in enumerate(stop_cases(story)):
        for include in (False, True):
            req_id = f"stream-{name}-{include}"
            engine.add_request(req_id, STORY_PROMPT, SamplingParams(
                temperature=0, max_tokens=60 + i, ignore_eos=True, stop=stops, include_stop_str_in_output=include,
                output_kind=RequestOutputKind.DELTA))
            finals[req_id] = text[:pos + len(winner)] if include else text[:pos]
    streamed: dict[str, str] = {r: "" for r in finals}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].text
            assert finals[out.request_id].startswith(streamed[out.request_id]), out.request_id
            if out.finished:
                assert out.outputs[0].finish_reason == "stop", out.request_id
    assert streamed == finals
    assert_all_blocks_free(llm_fp32)


# ---------------------------------------------------------------------------------------------- 4. n > 1


def test_parallel_sampling_shares_the_prompt(llm_fp32, hf_tokenizer):
    prompt = corpus_ids(hf_tokenizer)[11000:11130]  # 130 tokens: 8 full blocks before the last token
    params = SamplingParams(n=4, seed=42, temperature=1.0, max_tokens=16, ignore_eos=True)
    m0 = llm_fp32.get_metrics()
    out = llm_fp32.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    m1 = llm_fp32.get_metrics()
    assert out.finished and out.prompt_token_ids == prompt
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 4, texts
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    hits = m1["prefix_cache_hits"] - m0["prefix_cache_hits"]
    assert hits >= 3 * ((len(prompt) - 1) // 16 * 16), f"children hit only {hits} cached prompt tokens"
    # Seeded n=4 is reproducible as a whole.
    again = llm_fp32.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == texts
    assert_all_blocks_free(llm_fp32)


def test_parallel_sampling_streamed(llm_fp32):
    params = SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=20, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine = llm_fp32.llm_engine
    engine.add_request("par-stream", STORY_PROMPT, params)
    outputs = drain(engine)
    assert list(outputs) == ["par-stream"]
    texts: dict[int, str] = {}
    token_ids: dict[int, list[int]] = {}
    finished_at: Optional[int] = None
    for k, out in enumerate(outputs["par-stream"]):
        assert len(out.outputs) == 1
        c = out.outputs[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        token_ids.setdefault(c.index, []).extend(c.token_ids)
        if out.finished:
            finished_at = k
    assert finished_at == len(outputs["par-stream"]) - 1  # only the last output says finished
    final = llm_fp32.generate(STORY_PROMPT, params, use_tqdm=False)[0]  # FINAL_ONLY, same seeds
    assert sorted(texts) == [0, 1]
    assert texts == {c.index: c.text for c in final.outputs}
    assert token_ids == {c.index: c.token_ids for c in final.outputs}
    assert texts[0] != texts[1]
    assert_all_blocks_free(llm_fp32)


# ---------------------------------------------------------------------------------------------- 5. processors


def test_logits_processors(llm_fp32, hf_model, story):
    ids, text, offsets = story
    tok = llm_fp32.get_tokenizer()
    eos = tok.eos_token_id
    chat = {"prompt_token_ids": chat_ids(tok, SHORT_CHAT)}
    story_prompt_ids = tok.encode(STORY_PROMPT)

    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" dog", " cat", " and", ".", " sat")]
    assert all(len(tok.encode(w, add_special_tokens=False)) == 1 for w in (" dog", " cat", " and", ".", " sat"))
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    bad_word = tok.decode(ids[2:3]).strip()  # 'city', twice in the story
    bad_phrase = tok.decode(ids[4:6]).strip()  # 'Nova Haven': ' Haven' is banned only after ' Nova'
    assert tok.encode(" " + bad_phrase, add_special_tokens=False) == ids[4:6] and f" {bad_word} " in text

    greedy = dict(temperature=0, ignore_eos=True)
    requests = {
        "allowed": (STORY_PROMPT, SamplingParams(max_tokens=16, allowed_token_ids=allowed, **greedy)),
        "bias+": (STORY_PROMPT, SamplingParams(max_tokens=8, logit_bias={forced: 100.0}, **greedy)),
        "bias-": (STORY_PROMPT, SamplingParams(max_tokens=4, logit_bias={ids[0]: -100.0}, **greedy)),
        "bad_word": (STORY_PROMPT, SamplingParams(max_tokens=48, bad_words=[bad_word], **greedy)),
        "bad_phrase": (STORY_PROMPT, SamplingParams(max_tokens=16, bad_words=[bad_phrase], **greedy)),
        "chat": (chat, SamplingParams(temperature=0, max_tokens=40)),
        "min_tokens": (chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=20)),
        "ignore_eos": (chat, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    }
    outs = llm_fp32.generate([p for p, _ in requests.values()], [s for _, s in requests.values()], use_tqdm=False)
    got = {name: o.outputs[0] for name, o in zip(requests, outs)}

    # allowed_token_ids: only those ids, each the best of them by transformers' logits (teacher-forced).
    a = got["allowed"]
    assert set(a.token_ids) <= set(allowed) and len(a.token_ids) == 16
    rows = hf_logprobs(hf_model, story_prompt_ids + a.token_ids)[len(story_prompt_ids) - 1:-1]
    for row, token in zip(rows, a.token_ids):
        assert float(row[token]) >= float(row[allowed].max()) - ATOL

    assert got["bias+"].token_ids == [forced] * 8
    assert got["bias-"].token_ids[0] != ids[0]

    assert bad_word not in got["bad_word"].text and ids[2] not in got["bad_word"].token_ids
    assert got["bad_word"].token_ids[:2] == ids[:2]  # identical up to where the word was
    phrase = got["bad_phrase"]
    assert bad_phrase not in phrase.text
    assert phrase.token_ids[:5] == ids[:5] and phrase.token_ids[5] != ids[5]  # ' Nova' kept, ' Haven' not

    normal = got["chat"]
    assert normal.finish_reason == "stop" and normal.token_ids[-1] == eos and len(normal.token_ids) < 20
    m = got["min_tokens"]
    assert len(m.token_ids) >= 20 and eos not in m.token_ids[:20]
    assert m.token_ids[:len(normal.token_ids) - 1] == normal.token_ids[:-1]
    ig = got["ignore_eos"]
    assert len(ig.token_ids) == 24 and ig.finish_reason == "length"
    assert ig.token_ids[:len(normal.token_ids)] == normal.token_ids  # the EOS is emitted, then generation goes on
    assert_all_blocks_free(llm_fp32)
