"""OutputProcessor: a stop string completed inside a step of several ids (accepted speculative drafts)
ends the output at that id, with its logprobs and counts, exactly as one id per step would."""

from __future__ import annotations

import pytest

from vlite.core.sched.output import EngineCoreOutput
from vlite.engine.output_processor import OutputProcessor
from vlite.sampling_params import SamplingParams


def _logprobs(ids: list[int]) -> tuple[list[list[int]], list[list[float]], list[int]]:
    return [[t] for t in ids], [[-0.5 - i] for i in range(len(ids))], [1] * len(ids)


@pytest.mark.parametrize("engine_finished", [None, "length"])
def test_stop_string_inside_a_step_of_several_ids(hf_tokenizer, engine_finished):
    tok = hf_tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    end = next(i for i in range(1, len(ids) + 1) if "brown" in tok.decode(ids[:i]))
    assert end + 1 < len(ids)
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 2], SamplingParams(max_tokens=50, stop=["brown"], logprobs=0))
    out = proc.process_outputs([EngineCoreOutput("r", ids[:2], new_logprobs=_logprobs(ids[:2]))])
    assert out.reqs_to_abort == [] and out.iteration_stats.num_generation_tokens == 2
    rest = ids[2:]
    out = proc.process_outputs([EngineCoreOutput("r", rest, finish_reason=engine_finished,
                                                 new_logprobs=_logprobs(rest))])
    (result,) = out.request_outputs
    completion = result.outputs[0]
    assert completion.text == "The quick " and completion.finish_reason == "stop" and completion.stop_reason == "brown"
    assert list(completion.token_ids) == ids[:end]
    assert len(completion.logprobs) == end
    assert out.iteration_stats.num_generation_tokens == end - 2
    # still running in the engine core only when it had not finished the request itself
    assert out.reqs_to_abort == ([] if engine_finished else ["r"])
