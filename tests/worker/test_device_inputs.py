"""A step's arrays on the model's device: on the CPU the arrays themselves (no copy); on a GPU one
pinned buffer and one copy, split back into the arrays' shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlite.sample.metadata import SamplingMetadata
from vlite.worker.device_inputs import DeviceInputs


def _arrays() -> dict[str, np.ndarray]:
    return dict(input_ids=np.arange(5), block_table=np.arange(12).reshape(3, 4) * 7, slots=np.array([3, -1]))


def test_cpu_is_zero_copy():
    arrays = _arrays()
    out = DeviceInputs(torch.device("cpu"))(arrays)
    for name, a in arrays.items():
        assert out[name].data_ptr() == a.ctypes.data and out[name].shape == a.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy needs a GPU")
def test_cuda_one_copy_round_trips():
    to_device = DeviceInputs(torch.device("cuda"))
    for _ in range(2):  # the pinned buffer reused
        arrays = _arrays()
        out = to_device(arrays)
        for name, a in arrays.items():
            assert out[name].is_cuda and np.array_equal(out[name].cpu().numpy(), a)


def test_sampling_metadata_to_keeps_generators_and_values():
    gen = torch.Generator().manual_seed(1)
    md = SamplingMetadata(temperature=torch.tensor([0.5]), all_greedy=False, all_random=True, top_p=None,
                          top_k=None, min_p=None, generators={0: gen}, max_num_logprobs=None,
                          logit_bias=(torch.tensor([0]), torch.tensor([3]), torch.tensor([1.0])))
    moved = md.to(torch.device("cpu"))
    assert moved.generators[0] is gen and torch.equal(moved.temperature, md.temperature)
    assert isinstance(moved.logit_bias, tuple) and torch.equal(moved.logit_bias[1], torch.tensor([3]))
