"""At temperature > 0 speculative decoding keeps the target's distribution: samples drawn
through a disagreeing draft pass a chi-square test against the target's exact
probabilities, and fail it against the draft's. And it keeps target-only's very draws: with
the same seeds, the same tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2

from asr.decoder import DecoderRunner
from asr.rules import DecodingRules, Prefix
from asr.draft_length import DraftLength
from asr.speculative import SpeculativeDecoder
from conftest import BEGIN_SUPPRESS, EN, EOT, NO_TIMESTAMPS, SOT, SUPPRESS, TRANSCRIBE, decoder_only_draft, tiny_target

TEMPERATURE = 2.0
PROMPT = [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS]
RULES = DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS,
                      begin_suppress=BEGIN_SUPPRESS, timestamps=False)


def runner(model) -> DecoderRunner:
    return DecoderRunner(model.model.decoder, model.proj_out.weight)


@torch.inference_mode()
def exact_distribution(model, encoded: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    run = runner(model)
    cache = run.new_cache(encoded, capacity=16)
    logits = run.forward(torch.tensor([prefix]), torch.tensor([0]), cache)[:, -1]
    positions = torch.tensor([[len(prefix)]])
    RULES.apply(logits, Prefix.at(torch.tensor([prefix + [0]]), torch.tensor([len(PROMPT)]), positions, RULES.timestamp_begin))
    return torch.softmax(logits[0].float() / TEMPERATURE, -1)


def chi_square_p(counts: Counter, probs: torch.Tensor) -> float:
    total = sum(counts.values())
    expected = probs * total
    bins = (expected >= 5).nonzero()[:, 0].tolist()
    assert len(bins) >= 3, "distribution too peaked for a useful test"
    observed = [counts.get(t, 0) for t in bins]
    expect = [float(expected[t]) for t in bins]
    observed.append(total - sum(observed))
    expect.append(total - sum(expect))
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expect) if e > 0)
    return float(chi2.sf(statistic, len(observed) - 1))


@pytest.mark.parametrize("fixed", [False, True], ids=["fitted-shapes", "fixed-shapes"])
def test_sampling_keeps_the_target_distribution(fixed: bool):
    """In fixed shapes (a GPU's), a verification checks k proposals among a fixed width of
    positions, the rest stale: sampling must ignore those."""
    target = tiny_target(7, dtype=torch.float32)
    draft = decoder_only_draft(target, noise=0.05, seed=7)
    features = torch.randn(1, 80, 60, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        encoded = target.model.encoder(features).last_hidden_state
    rows = 250
    # Fixed shapes verify max_draft_tokens + 1 = 4 positions: k = 2 proposals and one stale (9 was a slower test).
    decoder = SpeculativeDecoder(runner(target), runner(draft), fixed_shapes=fixed, max_draft_tokens=3)
    samples, proposed, accepted = [], 0, 0
    for run in range(6):
        result = decoder.decode(encoded.expand(rows, -1, -1), [PROMPT] * rows, RULES, max_new_tokens=3,
                                temperature=TEMPERATURE, draft_length=DraftLength(fixed=2),
                                seeds=[run * rows + row for row in range(rows)])
        samples += [tuple(s.tokens) for s in result]
        proposed += sum(s.stats.draft_proposed for s in result)
        accepted += sum(s.stats.draft_accepted for s in result)
    assert 0.2 < accepted / proposed < 0.9, "the draft should be accepted sometimes, rejected sometimes"

    first = Counter(s[0] for s in samples if s)
    p_target = exact_distribution(target, encoded, PROMPT)
    assert chi_square_p(first, p_target) > 1e-3
    p_draft = exact_distribution(draft, encoded, PROMPT)
    assert chi_square_p(first, p_draft) < 1e-6, "the test must be able to tell the draft's distribution apart"

    # The second token, given the commonest first one, exercises acceptance after acceptance.
    top = first.most_common(1)[0][0]
    second = Counter(s[1] for s in samples if len(s) > 1 and s[0] == top)
    assert chi_square_p(second, exact_distribution(target, encoded, PROMPT + [top])) > 1e-3


@pytest.mark.parametrize("fixed", [False, True], ids=["fitted-shapes", "fixed-shapes"])
def test_hinted_rounds_keep_the_target_distribution(fixed: bool):
    """A hint's proposals (a retry at a higher temperature proposes the failed attempt) are
    accepted where the target draws them. Also when no proposal fits before a row's limit (max_new_tokens=1: the
    round verifies k = 0 proposals and must still sample). Half the rows have no hint and
    draft meanwhile, in the same rounds."""
    target = tiny_target(7, dtype=torch.float32)
    features = torch.randn(1, 80, 60, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        encoded = target.model.encoder(features).last_hidden_state
    p_target = exact_distribution(target, encoded, PROMPT)
    hint = [int(p_target.argmax()), *p_target.topk(3).indices[1:].tolist()]  # accepted sometimes, rejected sometimes
    decoder = SpeculativeDecoder(runner(target), runner(decoder_only_draft(target, noise=0.05, seed=7)), fixed_shapes=fixed,
                                 max_draft_tokens=2)  # fixed shapes verify 3 positions, not 9: a faster test
    rows = 250
    for max_new in (3, 1):
        samples, hint_proposed, hint_accepted, draft_proposed = ([], []), 0, 0, 0
        for run in range(4):
            result = decoder.decode(encoded.expand(rows, -1, -1), [PROMPT] * rows, RULES, max_new_tokens=max_new,
                                    temperature=TEMPERATURE, draft_length=DraftLength(fixed=2),
                                    hints=[hint if row % 2 else [] for row in range(rows)],
                                    seeds=[(max_new * 4 + run) * rows + row for row in range(rows)])
            for row, s in enumerate(result):
                samples[row % 2].append(s.tokens[0])
            hint_proposed += sum(s.stats.hint_proposed for s in result)
            hint_accepted += sum(s.stats.hint_accepted for s in result)
            draft_proposed += sum(s.stats.draft_proposed for s in result[::2])
        if max_new > 1:
            assert 0 < hint_accepted < hint_proposed, "the hint should be accepted sometimes, rejected sometimes"
            assert draft_proposed >= 2 * rows, "the rows without a hint draft in the hinted rounds"
        for hinted in (0, 1):
            assert chi_square_p(Counter(samples[hinted]), p_target) > 1e-3, f"max_new_tokens={max_new}, hinted={hinted}"


@pytest.mark.parametrize("fixed", [False, True], ids=["fitted-shapes", "fixed-shapes"])
def test_sampled_tokens_are_target_onlys_with_the_same_seeds(fixed: bool):
    """A row's draws follow its seed and nothing else: speculative decoding at any k, rows
    following hints, and a row decoded alone give target-only's tokens for the same seeds
    (float64, so that no rounding tells the pass widths apart). Before, rejection sampling
    kept only the target's distribution: which token came out depended on the draft's k
    and on the rows batched beside it."""
    target = tiny_target(7)
    draft = decoder_only_draft(target, noise=0.05, seed=7)
    features = torch.randn(4, 80, 60, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.inference_mode():
        encoded = target.model.encoder(features).last_hidden_state
    rows, temperature = 8, 1.0
    encoded = encoded[[row % 4 for row in range(rows)]]
    seeds = [1000 + row for row in range(rows)]
    decode = dict(max_new_tokens=20, temperature=temperature, seeds=seeds)
    plain = SpeculativeDecoder(runner(target), fixed_shapes=fixed).decode(encoded, [PROMPT] * rows, RULES, **decode)
    expected = [s.tokens for s in plain]
    assert expected[0] != expected[4], "rows of the same audio with other seeds draw otherwise"
    speculative = SpeculativeDecoder(runner(target), runner(draft), fixed_shapes=fixed, max_draft_tokens=4)
    for k in (1, 4):
        result = speculative.decode(encoded, [PROMPT] * rows, RULES, draft_length=DraftLength(fixed=k), **decode)
        assert [s.tokens for s in result] == expected, k
        accepted, proposed = (sum(getattr(s.stats, f"draft_{n}") for s in result) for n in ("accepted", "proposed"))
        assert 0 < accepted < proposed
    # Hints that the target follows for a while, then leaves (a retry proposing the failed attempt).
    hints = [tokens[:6] + [EOT - 1 - row] * 6 for row, tokens in enumerate(expected)]
    result = speculative.decode(encoded, [PROMPT] * rows, RULES, draft_length=DraftLength(fixed=2), hints=hints, **decode)
    assert [s.tokens for s in result] == expected
    assert sum(s.stats.hint_accepted for s in result) >= 5 * rows
    alone = speculative.decode(encoded[5:6], [PROMPT], RULES, max_new_tokens=20, temperature=temperature, seeds=seeds[5:6])
    assert alone[0].tokens == expected[5]
