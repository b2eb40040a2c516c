"""How many tokens the draft proposes in a round (k), chosen from measured costs."""

from __future__ import annotations


class DraftLength:
    """Chooses k, the draft tokens proposed in a round (0: the target alone). Fixed when asked;
    otherwise it maximises expected tokens per second,

        (1 - a^(k+1)) / (1 - a) / (k * draft_step + plain + k * per_proposal),

    from the measured per-token acceptance a, the measured cost of a draft step, and the cost
    of a target pass measured without proposals (plain) and with them. No drafting (k = 0,
    1 / plain) wins where drafting does not pay: in a large batch on a CPU, verifying k
    proposals for every row costs nearly what k plain passes do. Every EXPLORE-th round goes
    the other way (drafting or not), so that both stay measured. k is the best drafting
    length (>= 1); next_round() says what a round does."""

    EXPLORE = 16

    def __init__(self, fixed: int | None = None, maximum: int = 8, initial: int = 4):
        self.fixed = fixed
        self.maximum = fixed if fixed is not None else maximum
        self.k = fixed if fixed is not None else min(initial, maximum)
        self._accepted = 1.0  # decayed counts, starting from a mild prior
        self._rejected = 1.0
        self._draft_step: float | None = None
        self._verify: float | None = None  # a target pass checking proposals (_proposals on average)
        self._proposals: float | None = None
        self._plain: float | None = None  # a target pass without proposals
        self._plain_wins = False
        self._rounds = 0

    def next_round(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self._rounds += 1
        explore = self._rounds % self.EXPLORE == 0 or (self._plain is None and self._draft_step is not None)
        return self.k if self._plain_wins == explore else 0

    def update(self, k: int, accepted: int, rejected: int, draft_seconds_per_step: float, verify_seconds: float) -> None:
        """A round's outcome: k proposed per row, accepted in all, rows that rejected one."""
        if self.fixed is not None:
            return
        if k == 0:
            self._plain = _average(self._plain, verify_seconds)
        else:
            decay = 0.9
            self._accepted = decay * self._accepted + accepted
            self._rejected = decay * self._rejected + rejected
            self._draft_step = _average(self._draft_step, draft_seconds_per_step)
            self._verify = _average(self._verify, verify_seconds)
            self._proposals = _average(self._proposals, float(k))
        if self._draft_step is None:
            return
        alpha = self._accepted / (self._accepted + self._rejected)
        plain, verify = self._plain, self._verify

        def tokens_per_second(k: int) -> float:
            expected = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
            if plain is None:
                return expected / (k * self._draft_step + verify)
            per_proposal = max(verify - plain, 0.0) / self._proposals
            return expected / (k * self._draft_step + plain + k * per_proposal)

        self.k = max(range(1, self.maximum + 1), key=tokens_per_second)
        self._plain_wins = plain is not None and tokens_per_second(0) > tokens_per_second(self.k)


def _average(mean: float | None, value: float) -> float:
    """An exponential moving average (the machine's speed drifts; batches shrink)."""
    return value if mean is None else 0.7 * mean + 0.3 * value
