"""Sampling at temperature > 0 without a random number generator inside a step: every
draw reads uniforms drawn beforehand (in (0, 1]), so a step can be captured as a CUDA
graph and replayed with fresh ones. Rows at temperature 0 stay greedy beside sampled rows.

Rejection sampling keeps the target's distribution (Leviathan et al. 2023, Chen et al.
2023): proposal j is accepted with probability min(1, p_j / q_j); at the first rejection
a token is drawn from normalise(max(p - q, 0)), and after k acceptances from p_k."""

from __future__ import annotations

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-5  # greedy rows divide by this harmlessly: their draws are never used


def draw(weights: Tensor, u: Tensor) -> Tensor:
    """One index per row of weights [..., V] (non-negative, not necessarily normalised),
    by the inverse of its cumulative sum, with uniforms u [...] in (0, 1]: an index whose
    weight is zero is never drawn."""
    cumulative = weights.cumsum(-1)
    index = torch.searchsorted(cumulative, (u * cumulative[..., -1]).unsqueeze(-1)).squeeze(-1)
    return index.clamp(max=weights.shape[-1] - 1)


def probabilities(logits: Tensor, temperature: Tensor) -> Tensor:
    """softmax(logits / temperature) in float32; temperature [B] applies along dim 0."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    return torch.softmax(logits.float() / temperature.clamp(min=MIN_TEMPERATURE).view(shape), -1)


def choose(logits: Tensor, temperature: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """A token per row of logits [B, V]: drawn from its distribution at the row's temperature,
    or its argmax at temperature 0. Returns the tokens [B] and the distributions [B, V]."""
    probs = probabilities(logits, temperature)
    return torch.where(temperature > 0, draw(probs, u), logits.argmax(-1)), probs


def greedy(logits: Tensor, proposals: Tensor, proposed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Greedy verification of proposals [B, k] against the target's logits [B, k+1, V]: each
    is accepted where it is the argmax and the ones before it were (proposed: as verify's).
    Returns the accepted count [B] and the argmax at every position [B, k+1]."""
    chosen = logits.argmax(-1)
    right = proposals == chosen[:, : proposals.shape[1]]
    return (right if proposed is None else right & proposed).long().cumprod(1).sum(1), chosen


def verify(logits: Tensor, proposals: Tensor, temperature: Tensor, draft_probs: Tensor, u: Tensor,
           proposed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Rejection sampling of proposals [B, k] against the target's logits [B, k+1, V]; the
    draft's distributions draft_probs [B, k, V]; uniforms u [B, 2k+1]; proposed [1, k]:
    which of the k are proposals (the first ones; None: all), the rest stale. Returns the
    accepted count [B] and the token chosen at every position [B, k+1], of which index
    `accepted` is the one kept. Rows at temperature 0 accept the proposals equal to the argmax."""
    k = proposals.shape[1]
    greedy_accepted, greedy_chosen = greedy(logits, proposals, proposed)
    p = probabilities(logits, temperature)
    index = proposals[:, :, None]
    right = u[:, :k] * draft_probs.gather(2, index)[:, :, 0] < p[:, :k].gather(2, index)[:, :, 0]
    corrected = (p[:, :k] - draft_probs).clamp(min=0)
    if proposed is not None:
        right = right & proposed
        corrected = torch.where(proposed[:, :, None], corrected, p[:, :k])  # past the proposals: the target's own
    accepted = right.long().cumprod(1).sum(1)
    residual = torch.cat([corrected, p[:, k:]], 1)
    # p == q exactly leaves no residual mass; then the target's own distribution is exact.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    chosen = draw(residual, u[:, k:])
    sampled = temperature > 0
    return torch.where(sampled, accepted, greedy_accepted), torch.where(sampled[:, None], chosen, greedy_chosen)
