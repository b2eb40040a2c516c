"""How many tokens the draft proposes in a round (k), chosen from measured costs."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import median_low
from typing import Iterable

PRIOR = (1.0, 1.0)  # a language's (accepted, rejected) before any round: a mild prior
RECENT = 5  # rounds of each kind whose times are kept; their median sets the costs


def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """Tokens a target pass keeps when each of k proposals is right with probability alpha."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass
class _Costs:
    """What one batch size measured, and what it chose."""

    k: int  # the best drafting length (>= 1) so far
    interval: int  # rounds between two that go the other way
    until_explore: int
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))  # seconds of rounds without proposals
    drafting: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RECENT))  # (seconds, proposals)
    plain_wins: bool = False
    exploring: bool = False
    wide: bool = False  # where plain wins, whether the next round going the other way drafts k, not 1
    languages: list[str | None] = field(default_factory=list)  # the live rows' of the round under way
    rounds: Counter[int] = field(default_factory=Counter)  # rounds measured, by k


class DraftLength:
    """Chooses k, the draft tokens proposed in a round (0: the target alone). Fixed when asked;
    otherwise it maximises expected tokens per second,

        (1 - a^(k+1)) / (1 - a) / (plain + overhead + k * per_proposal),

    from the measured per-token acceptance a and the measured wall time of whole rounds:
    plain ones (k = 0), and drafting ones, whose time beyond a plain round is an overhead a
    round (the draft's catch-up step, the verification's launch) and per_proposal per
    proposal (a draft step and its share of the verification; _drafting_costs), each from
    medians of the last RECENT rounds of its kind, so that one stalled round (a garbage
    collection, another process, work queued before it on a GPU) does not decide k for the
    next hundreds of rounds (a plain one is outvoted once a second is measured; a drafting
    one leaves no overhead to fit, and the rest decide); a lasting change shows after three
    rounds of its kind (for the way not taken, measured every 16 to 64 rounds, up to a few
    hundred rounds later). Whole rounds, because a round's cost is not always its kernels: on a GPU, a
    small model's round is mostly the host's launches and its one read. No drafting (k = 0) wins where drafting does not pay:
    in a large batch on a CPU, where verifying k proposals per row costs nearly k plain
    passes, or with a small target on a GPU. Costs, and so k, are kept per batch size (the
    rows a round computes, up to a power of two): a batch that grows or drains gets the k
    of its size. The acceptance is the draft's on a language (an English-only draft is
    rarely right on German), kept per language and averaged over a round's rows. Now and
    then a round goes the other way, so that both stay measured: a plain round, or where
    no drafting wins, a drafting round, of one proposal (the cheapest) and of the best k
    (2 at least) in turn: two lengths, to tell the overhead from the proposals. While
    drafting wins, its rounds are mostly of one k, whose cost is then taken all per proposal. Such a round comes every
    EXPLORE rounds, and half as often each time it confirms the choice (down to one in
    MAX_EXPLORE), since each costs what the losing way loses. next_round() says what a
    round does."""

    EXPLORE = 16
    MAX_EXPLORE = 64

    def __init__(self, fixed: int | None = None, maximum: int = 8, initial: int = 4):
        for value in (fixed, maximum):  # a negative k ran the batch target-only, unsaid
            if value is not None and value < 0:
                raise ValueError(f"a draft length is a count of tokens, 0 or more, not {value}")
        self.fixed = fixed
        self.maximum = fixed if fixed is not None else maximum
        # At least 1 where drafting may be chosen: from 0 no drafting round was ever measured, nor k chosen.
        self.initial = fixed if fixed is not None else min(max(initial, 1), maximum)
        self._acceptance: dict[str | None, tuple[float, float]] = {}  # decayed (accepted, rejected) per language
        self._by_rows: dict[int, _Costs] = {}

    def acceptance(self, language: str | None = None) -> float:
        accepted, rejected = self._acceptance.get(language, PRIOR)
        return accepted / (accepted + rejected)

    def _costs(self, rows: int) -> _Costs:
        size = 1 << (rows - 1).bit_length()  # sizes up to a power of two share their costs
        if size not in self._by_rows:
            self._by_rows[size] = _Costs(self.initial, self.EXPLORE, self.EXPLORE)
        return self._by_rows[size]

    def next_round(self, rows: int = 1, languages: Iterable[str | None] = (None,)) -> int:
        """k for a round of a batch of `rows` rows; languages: its live rows'."""
        if self.fixed is not None:
            return self.fixed
        c = self._costs(rows)
        c.languages = list(languages)
        self._choose(c)
        c.until_explore -= 1
        c.exploring = c.until_explore <= 0 or (not c.plain and bool(c.drafting))
        if c.until_explore <= 0:
            c.until_explore = c.interval
        if c.plain_wins:  # the wide try: 2 at least, or rounds of one proposal alone would never tell the overhead
            return (max(c.k, min(2, self.maximum)) if c.wide else 1) if c.exploring else 0
        return 0 if c.exploring else c.k

    def current(self, rows: int = 1, languages: Iterable[str | None] = (None,)) -> int:
        """k as measured so far for a round that goes unmeasured and explores nothing (rows
        drafting beside rows that follow their hints)."""
        if self.fixed is not None:
            return self.fixed
        c = self._costs(rows)
        c.languages = list(languages)
        self._choose(c)
        return 0 if c.plain_wins else c.k

    def update(self, k: int, seconds: float, rows: int = 1, accepted: Iterable[tuple[str | None, int, int]] = ()) -> None:
        """A round's outcome: k proposed per row, the round's wall time, the rows it computed,
        and each live row's language, proposals accepted, and proposals that count (fewer than
        k where its draft proposed end-of-text, or its limit came: not a rejection)."""
        if self.fixed is not None:
            return
        c = self._costs(rows)
        c.rounds[k] += 1
        if k == 0:
            c.plain.append(seconds)
        else:
            outcomes: dict[str | None, tuple[int, int]] = {}  # per language: accepted, rows that rejected one
            for language, kept, proposed in accepted:
                before = outcomes.get(language, (0, 0))
                outcomes[language] = (before[0] + kept, before[1] + (kept < proposed))
            # Forgets in about 14 drafting rounds: at 0.9 (7), the estimate from rounds of one
            # proposal wandered enough to stop drafting that paid.
            decay = 0.95
            for language, (kept, rejected) in outcomes.items():
                before = self._acceptance.get(language, PRIOR)
                self._acceptance[language] = (decay * before[0] + kept, decay * before[1] + rejected)
            c.drafting.append((seconds, k))
            if c.exploring and c.plain_wins:  # measured: the next one drafts the other length
                c.wide = not c.wide
        chosen = c.plain_wins
        if c.exploring and self._choose(c):  # only a round going the other way needs the choice now: next_round makes it
            confirmed = c.plain_wins == chosen
            c.interval = min(2 * c.interval, self.MAX_EXPLORE) if confirmed else self.EXPLORE
            c.until_explore = min(c.until_explore, c.interval)

    def unmeasured(self, rows: int = 1) -> None:
        """A round whose time says nothing of a round's cost (its draft first caught up with
        the tokens of plain rounds, or its steps ran for the first time): where it was the
        round going the other way, the next round goes that way again, to be measured."""
        if self.fixed is None and (c := self._costs(rows)).exploring:
            c.until_explore = 1

    def summary(self) -> dict:
        """What it measured and chose, for a report: the acceptance per language, and per batch
        size (rows up to a power of two) the rounds measured by k, the costs it last fitted
        (milliseconds: a plain round, a drafting round's overhead, a proposal) and its choice."""
        sizes = {}
        for size, c in sorted(self._by_rows.items()):
            entry: dict = {"rounds_by_k": dict(sorted(c.rounds.items()))}
            if self._choose(c):  # from the costs below (the last round's languages)
                plain = median_low(c.plain)
                overhead, per_proposal = _drafting_costs(plain, c.drafting)
                entry.update(plain_round_ms=1e3 * plain, overhead_ms=1e3 * overhead, per_proposal_ms=1e3 * per_proposal,
                             k=0 if c.plain_wins else c.k)
            sizes[size] = entry
        return {"fixed": self.fixed, "acceptance": {language or "-": self.acceptance(language) for language in self._acceptance},
                "by_rows": sizes}

    def _choose(self, c: _Costs) -> bool:
        """Sets c.k and c.plain_wins from the measured costs and the acceptance of the round's
        languages; False while a cost is still unmeasured."""
        if not c.plain or not c.drafting:
            return False
        languages = c.languages or [None]
        alpha = sum(self.acceptance(language) for language in languages) / len(languages)
        plain = median_low(c.plain)  # the lower of two: a stall only ever adds time
        overhead, per_proposal = _drafting_costs(plain, c.drafting)

        def tokens_per_second(k: int) -> float:
            return expected_tokens_per_pass(alpha, k) / (plain + (overhead + k * per_proposal if k else 0.0))

        c.k = max(range(1, self.maximum + 1), key=tokens_per_second)
        c.plain_wins = tokens_per_second(0) > tokens_per_second(c.k)
        return True




def _drafting_costs(plain: float, drafting: Iterable[tuple[float, int]]) -> tuple[float, float]:
    """A drafting round's time beyond a plain one, as overhead + k * per_proposal (the
    draft's catch-up step and the verification's own launch cost a round, whatever k).
    Taken all per proposal, k = 1 rounds (on a CPU about twice the marginal cost of a
    proposal) made drafting look too dear to try more than one proposal again. From the lower median
    at each k measured (a stall only ever adds time): where two k or more were, the median
    of the slopes between them, and of what each leaves beyond its slope; where that has
    no overhead to give (a stalled round's k), or one k was measured, all per proposal."""
    extra: dict[int, list[float]] = {}
    for seconds, k in drafting:
        extra.setdefault(k, []).append(max(seconds - plain, 0.0))
    points = [(k, median_low(times)) for k, times in extra.items()]
    slopes = [(e2 - e1) / (k2 - k1) for i, (k1, e1) in enumerate(points) for k2, e2 in points[i + 1 :]]
    if slopes and (per_proposal := median_low(slopes)) >= 0:
        if (overhead := median_low([e - k * per_proposal for k, e in points])) >= 0:
            return overhead, per_proposal
    return 0.0, median_low([e / k for k, times in extra.items() for e in times])
