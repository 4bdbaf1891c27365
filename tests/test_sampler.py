"""The sampler against direct computations: greedy, top-k/top-p support, seeds, banned ids,
logprobs."""

from __future__ import annotations

import torch

from appliance.engine.sampler import Sampler, SampleRequest, _apply_top_k_top_p, argmax_rows
from appliance.sampling_params import SamplingParams


def req(**kw: object) -> SampleRequest:
    return SampleRequest(SamplingParams(**kw), output_index=0, banned_token_ids=[])  # type: ignore[arg-type]


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    logits = torch.randn(4, 50)
    tokens, lps = Sampler()(logits.clone(), [req(temperature=0.0, logprobs=3)] * 4)
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(lps):
        assert lp is not None
        assert abs(lp.logprob - ref[i, tokens[i]].item()) < 1e-5
        assert lp.top_ids == ref[i].topk(3).indices.tolist()


def test_top_k_and_top_p_restrict_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    masked = _apply_top_k_top_p(logits.clone(), torch.tensor([5]), torch.tensor([1.0]))
    assert set(torch.isfinite(masked[0]).nonzero().view(-1).tolist()) == set(
        logits[0].topk(5).indices.tolist()
    )
    probs = torch.softmax(logits, -1)[0]
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    keep = int((cum < 0.5).sum()) + 1
    masked = _apply_top_k_top_p(logits.clone(), torch.tensor([0]), torch.tensor([0.5]))
    assert set(torch.isfinite(masked[0]).nonzero().view(-1).tolist()) == set(order[:keep].tolist())
    sampler = Sampler()
    for _ in range(50):
        tok, _ = sampler(logits.clone(), [req(temperature=1.0, top_k=5)])
        assert tok[0] in logits[0].topk(5).indices.tolist()


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    logits = torch.randn(1, 1000)
    alone, _ = Sampler(seed=1)(logits.clone(), [req(temperature=1.0, seed=42)])
    batch_logits = torch.cat([torch.randn(3, 1000), logits])
    batched, _ = Sampler(seed=2)(
        batch_logits, [req(temperature=1.0)] * 3 + [req(temperature=1.0, seed=42)]
    )
    assert batched[3] == alone[0]
    draws = {
        Sampler()(logits.clone(), [SampleRequest(SamplingParams(temperature=1.0, seed=42), i, [])])[
            0
        ][0]
        for i in range(20)
    }
    assert len(draws) > 1  # different positions draw differently


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(seed=0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits.clone(), [req(temperature=1.0)])[0][0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 100.0
    tok, _ = Sampler()(logits, [SampleRequest(SamplingParams(temperature=0.0), 0, [3])])
    assert tok[0] != 3


def test_argmax_rows_agrees_with_torch_on_ties_infinities_and_nan() -> None:
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(6, 1001, generator=gen)
    values[1, [5, 700]] = 9.0  # a tie: the first index wins
    values[2] = float("-inf")  # all masked
    values[2, 999] = 0.0
    values[3, 42] = float("nan")  # a NaN counts as the largest
    values[4, :] = 1.5  # all equal
    values[5, -1] = float("inf")
    expected = values.argmax(dim=-1)
    got = argmax_rows(values)
    assert got.dtype == torch.int64
    assert got.tolist() == expected.tolist() == [int(values[0].argmax()), 5, 999, 42, 0, 1000]
    assert (
        argmax_rows(values.to(torch.bfloat16)).tolist()
        == values.to(torch.bfloat16).argmax(-1).tolist()
    )
