"""How many tokens the draft proposes in a round (k), chosen from measured costs."""

from __future__ import annotations


class DraftLength:
    """Chooses k, the draft tokens proposed in a round (0: the target alone). Fixed when asked;
    otherwise it maximises expected tokens per second,

        (1 - a^(k+1)) / (1 - a) / (plain + k * per_proposal),

    from the measured per-token acceptance a and the measured wall time of whole rounds:
    plain ones (k = 0), and drafting ones, whose time beyond a plain round is per_proposal
    per proposal (a draft step and its share of the verification). Whole rounds, because a
    round's cost is not always its kernels: on a GPU, a small model's round is mostly the
    host's launches and its one read. No drafting (k = 0) wins where drafting does not pay:
    in a large batch on a CPU, where verifying k proposals per row costs nearly k plain
    passes, or with a small target on a GPU. Now and then a round goes the other way, so
    that both stay measured: a plain round, or where no drafting wins, a round of one
    proposal (the cheapest). Such a round comes every EXPLORE rounds, and half as often
    each time it confirms the choice (down to one in MAX_EXPLORE), since each costs what
    the losing way loses. k is the best drafting length (>= 1); next_round() says what a
    round does."""

    EXPLORE = 16
    MAX_EXPLORE = 64

    def __init__(self, fixed: int | None = None, maximum: int = 8, initial: int = 4):
        self.fixed = fixed
        self.maximum = fixed if fixed is not None else maximum
        self.k = fixed if fixed is not None else min(initial, maximum)
        self._accepted = 1.0  # decayed counts, starting from a mild prior
        self._rejected = 1.0
        self._plain: float | None = None  # seconds of a round without proposals
        self._drafting: float | None = None  # seconds of a drafting round, of _proposals proposals on average
        self._proposals: float | None = None
        self._plain_wins = False
        self._interval = self.EXPLORE  # rounds between two that go the other way
        self._until_explore = self.EXPLORE
        self._exploring = False

    def next_round(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self._until_explore -= 1
        self._exploring = self._until_explore <= 0 or (self._plain is None and self._drafting is not None)
        if self._until_explore <= 0:
            self._until_explore = self._interval
        if self._plain_wins:
            return 1 if self._exploring else 0
        return 0 if self._exploring else self.k

    def update(self, k: int, accepted: int, rejected: int, seconds: float) -> None:
        """A round's outcome: k proposed per row, accepted in all, rows that rejected one, and
        the round's wall time."""
        if self.fixed is not None:
            return
        if k == 0:
            self._plain = _average(self._plain, seconds)
        else:
            decay = 0.9
            self._accepted = decay * self._accepted + accepted
            self._rejected = decay * self._rejected + rejected
            self._drafting = _average(self._drafting, seconds)
            self._proposals = _average(self._proposals, float(k))
        if self._plain is None or self._drafting is None:
            return
        alpha = self._accepted / (self._accepted + self._rejected)
        per_proposal = max(self._drafting - self._plain, 0.0) / self._proposals

        def tokens_per_second(k: int) -> float:
            expected = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
            return expected / (self._plain + k * per_proposal)

        self.k = max(range(1, self.maximum + 1), key=tokens_per_second)
        plain_wins = tokens_per_second(0) > tokens_per_second(self.k)
        if self._exploring:
            confirmed = plain_wins == self._plain_wins
            self._interval = min(2 * self._interval, self.MAX_EXPLORE) if confirmed else self.EXPLORE
            self._until_explore = min(self._until_explore, self._interval)
        self._plain_wins = plain_wins


def _average(mean: float | None, value: float) -> float:
    """An exponential moving average (the machine's speed drifts; batches shrink)."""
    return value if mean is None else 0.7 * mean + 0.3 * value
