"""The sampler on the logits' device (`model/torch/sampling.py`, a GPU runner's) against the
host's (`model/sampler.py`): the same penalties and biases, the same kept tokens and
probabilities under temperature, top-k, top-p and min-p, greedy rows the same tokens, draws
from the same distribution; seeded rows and logprobs left to the host. Runs on CPU tensors
(the code is the device's)."""
import numpy as np
import pytest
import torch

from edgepaged.model import sampler as host
from edgepaged.model.params import SamplingParams
from edgepaged.model.torch import sampling as device

V = 50


def _logits(b, seed=0):
    return np.random.default_rng(seed).standard_normal((b, V)).astype(np.float32) * 3


PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.1, top_k=20),
          SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05),
          SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={7: 5.0, 9: -100.0}),
          SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.7, top_k=10)]
PREV = [[1, 2, 3], [4, 4, 5], [], [6], [7, 8, 9, 9], [7, 11, 12, 7], [13, 14, 14, 14]]
OUTS = [[3], [5, 5], [], [6], [9], [7, 12], [14, 14, 14, 2]]


def test_penalties_and_filters_equal_the_host_samplers():
    x = _logits(len(PARAMS))
    want = host.prepare(x, PARAMS, PREV, OUTS)
    got = device.prepare(torch.from_numpy(x), PARAMS, PREV, OUTS).numpy()
    assert np.allclose(got, want, atol=1e-6)
    rows = [i for i, p in enumerate(PARAMS) if not p.greedy]
    sub = [PARAMS[i] for i in rows]
    want_p = host._filter(want[rows], sub)
    got_p = device._filter(torch.from_numpy(want[rows]), sub).numpy()
    assert np.array_equal(got_p > 0, want_p > 0)              # the same tokens kept
    assert np.allclose(got_p, want_p, atol=1e-6)


def test_greedy_rows_are_the_hosts_tokens_and_draws_follow_the_distribution():
    x = _logits(len(PARAMS), seed=1)
    got = device.sample(torch.from_numpy(x), PARAMS, PREV, OUTS, generator=torch.Generator().manual_seed(0))
    want = host.sample(x, PARAMS, PREV, OUTS)
    for i, p in enumerate(PARAMS):
        if p.greedy:
            assert got[i] == want[i]
    # one sampled row drawn many times: the host's probabilities, within the draws' noise
    p = SamplingParams(temperature=0.9, top_p=0.9)
    row = torch.from_numpy(np.repeat(x[2:3], 20000, axis=0))
    draws = device.sample(row, [p] * len(row), generator=torch.Generator().manual_seed(1))
    freq = np.bincount(draws, minlength=V) / len(draws)
    probs = host._filter(x[2:3], [p])[0]
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(probs))
    assert np.abs(freq - probs).max() < 0.015


def test_seeded_rows_and_logprobs_stay_on_the_host():
    x = torch.from_numpy(_logits(2))
    assert device.sample(x, [SamplingParams(temperature=0.7, seed=3), SamplingParams()]) is None
    assert device.sample(x, [SamplingParams(logprobs=2), SamplingParams()]) is None
    with pytest.raises(ValueError, match="past the vocabulary"):
        device.sample(x, [SamplingParams(temperature=1.0, top_k=V + 1)] * 2)


def test_a_formats_mask_applies_on_the_device():
    """A format's allowed-token bits (`Masks`) applied where the logits are: a constrained
    greedy row picks the host's token among the allowed ones, a sampled row only allowed
    ones, the other rows as if no mask."""
    from edgepaged.constrain.grammar import Masks
    x = _logits(3, seed=4)
    allowed = np.zeros((2, 64), np.uint8)
    allowed[0, [3, 17]] = 1
    allowed[1, [5, 6, 40]] = 1
    bits = np.packbits(allowed, axis=1, bitorder="little").view(np.int32)
    masks = Masks([0, 2], bits, V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    host_logits = x.copy()
    masks.apply(host_logits)
    want = host.sample(host_logits, params)
    for seed in range(20):
        got = device.sample(torch.from_numpy(x), params, masks=masks, generator=torch.Generator().manual_seed(seed))
        assert got[0] == want[0] and got[0] in (3, 17) and got[1] == want[1] == int(x[1].argmax())
        assert got[2] in (5, 6, 40)
