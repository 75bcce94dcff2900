"""How long a step takes, from its shape: the prefill token cap of chunked prefill.

A step that carries a prompt chunk is longer than a decode-only step, and
every request decoding in it waits for the whole step: its inter-token latency
(ITL) is the step's time. With a fixed token budget
(``max_num_batched_tokens``) a 2,048-token chunk makes the decoding requests'
next token several times later than the one before. The scheduler instead
caps a step's prefill tokens while requests decode, so the step's predicted
time stays within ``chunked_prefill_itl_ratio`` times a decode-only step's.
vLLM caps per request with a fixed ``long_prefill_token_threshold`` and SGLang
with a fixed ``chunked_prefill_size``; a fixed cap is right for one machine
and one model only, so this one is derived from the worker's measured step
times and holds wherever the engine runs.

The estimate is linear in the step's shape and its prompt chunks' attention
(the worker's time: forward plus sampling, ``ModelRunnerOutput``)::

    t(D, P, K) = a + b * D + c * P + e * K

``D``: decode rows (requests given their next token, with any drafts), ``P``:
prefill tokens (prompt chunks, recomputation after a preemption, drafts),
``K``: the prefill tokens' context, summed (a chunk of ``n`` tokens after
``s`` computed ones attends to ``s + 1 .. s + n`` keys: ``n * s + n (n + 1) / 2``,
``prefill_context``). Causal attention makes a chunk's cost grow with its
prefix (the FLOPs of Vaswani et al. 2017, §4, Table 1: ``O(n * d)`` per token
attending to ``n`` keys), so the later chunks of a long prompt cost more than
its first one of as many tokens; a model in ``P`` alone fits their mean and
under-predicts the last chunks, which set the ITL's p99.
``a`` and ``b`` are the least-squares line through the last ``window``
decode-only steps; ``c`` and ``e`` the least-squares fit through the origin of
the last ``window`` prefill steps' time beyond ``a + b * D``, where both come out
positive and the steps tell them apart; otherwise (chunks all of one size at
one offset, or noise) ``e = 0`` and ``c`` the slope alone, the linear model.
Decode-only and prefill steps are kept apart so a long run of either does not
push the other out of the window. A mixed step may also pay a cost per step
(where the model runs prompt chunks on a slower path than decode rows; on the
CPU the fused C++ layers take both), which the slope through the origin
charges to its tokens: at a steady chunk size that is exact, and the cap
settles where the step's whole time meets the ratio; the slopes are fitted to
mixed steps only once there are any. Where the decode-only steps cannot place
the line (all of one batch size, or a fit with a negative part) it goes
through the origin (``a = 0``): that errs toward a smaller cap, never a longer
step, as it charges the intercept of a prefill-only step to its tokens and
predicts less time, not more, for a smaller batch.

The machine's speed is not fixed (other work on its cores, the engine's own): each
sample's weight in both fits halves every ``HALF_LIFE_STEPS`` steps, a prefill step
faster than the decode line allows for its rows is left out, and the cap divides its
budget by ``correction()``, how much longer the latest mixed steps took than the fit
predicted for them. The scheduler runs a decode-only step after
``REFERENCE_REFRESH_STEPS`` mixed ones in a row, so the decode line is measured again
while prompts keep arriving (aioengine/core/scheduler.py).
"""

from __future__ import annotations

import math
from collections import deque

# Below this many samples of each kind the estimate is not trusted (None).
MIN_SAMPLES = 1
# The prefill steps' (P, K) tell ``c`` from ``e`` only when their correlation is
# below 1 by more than this (relative determinant of the normal equations):
# chunks all of one size at one offset do not.
RANK_TOLERANCE = 1e-6
# A prefill token always costs something: the floor of ``c`` when noise (a shared
# machine) or a machine that just slowed (its earlier chunks then look cheaper than
# free beside the new decode line) makes the slope come out at or below 0. The cap
# trusts no such fit: it is 0 (the scheduler's floor, one block) until the slope is
# positive again, never the whole budget.
MIN_TOKEN_COST = 1e-9
# Steps (of either kind) after which a sample's weight in the fit halves: the fit
# follows a machine that slowed or sped up (other work on its cores) within a few
# dozen steps, not only once ``window`` newer samples of each kind pushed the old out.
HALF_LIFE_STEPS = 16
# The latest mixed steps whose measured prefill part corrects the fit's prediction
# (``StepCostModel.correction``), and the bounds of that factor.
CORRECTION_WINDOW = 8
CORRECTION_RANGE = (1.0, 4.0)


def prefill_context(num_computed: int, num_new: int) -> int:
    """Keys a chunk's queries attend to, summed (causal attention): ``num_new``
    tokens after ``num_computed`` ones, token ``j`` attending to ``j + 1`` keys:
    ``num_new * num_computed + num_new * (num_new + 1) / 2``."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


class StepCostModel:
    """Running estimate of a step's time from its decode rows, prefill tokens
    and the prefill tokens' attention context.

    Args:
        window: steps of each kind (decode-only, with prefill) the fit uses.

    Raises:
        ValueError: ``window`` below ``MIN_SAMPLES``.
    """

    def __init__(self, window: int = 64) -> None:
        if window < MIN_SAMPLES:
            raise ValueError(f"window must be >= {MIN_SAMPLES}, got {window}")
        # Each sample with the number of the step it was (``_num_observed`` then).
        self._decode_steps: deque[tuple[int, float, int]] = deque(maxlen=window)
        self._prefill_steps: deque[tuple[int, int, int, float, int]] = deque(maxlen=window)
        self._num_observed = 0
        self._fit: tuple[float, float, float, float] | None = None
        self._slope = MIN_TOKEN_COST  # the linear model's c (e = 0), same steps
        self._stale = False
        # (predicted, measured) time beyond the decode rows' of the latest mixed steps.
        self._mixed_errors: deque[tuple[float, float]] = deque(maxlen=CORRECTION_WINDOW)

    def observe(
        self,
        num_decode_rows: int,
        num_prefill_tokens: int,
        step_time: float,
        context: int | None = None,
    ) -> None:
        """Record one step the worker ran: its shape and its time in seconds.
        ``context``: its prefill tokens' attention context, summed
        (``prefill_context`` over its chunks; None: chunks at offset 0, one per
        step). A time that is not a positive finite number (no time reported, a
        clock that went back, NaN or inf from a worker) is ignored: one would
        poison the window's fit, and the scheduler's cap with it, for ``window``
        steps."""
        if not 0 < step_time < math.inf or num_decode_rows + num_prefill_tokens <= 0:
            return  # an empty step, or a worker that reports no usable time
        if num_prefill_tokens:
            if context is None:
                context = prefill_context(0, num_prefill_tokens)
            # Against the fit the cap last used (its prediction for this chunk).
            if num_decode_rows and (fit := self._fit) is not None:
                a, b, c, e = fit
                self._mixed_errors.append(
                    (c * num_prefill_tokens + e * context, step_time - a - b * num_decode_rows)
                )
            self._prefill_steps.append(
                (num_decode_rows, num_prefill_tokens, context, step_time, self._num_observed)
            )
        else:
            self._decode_steps.append((num_decode_rows, step_time, self._num_observed))
        self._num_observed += 1
        self._stale = True

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """``(a, b, c, e)`` in seconds, seconds per decode row, seconds per
        prefill token, seconds per attended key of a prefill token; None until
        ``MIN_SAMPLES`` steps of each kind were observed."""
        if self._stale:
            self._fit = self._refit()
            self._stale = False
        return self._fit

    def _refit(self) -> tuple[float, float, float, float] | None:
        if len(self._decode_steps) < MIN_SAMPLES or len(self._prefill_steps) < MIN_SAMPLES:
            return None
        newest = self._num_observed - 1
        decodes = [(d, t, _recency(newest - i)) for d, t, i in self._decode_steps]
        total = sum(w for _, _, w in decodes)
        mean_d = sum(w * d for d, _, w in decodes) / total
        mean_t = sum(w * t for _, t, w in decodes) / total
        var_d = sum(w * (d - mean_d) ** 2 for d, _, w in decodes)
        cov_dt = sum(w * (d - mean_d) * (t - mean_t) for d, t, w in decodes)
        # Batch sizes that differ only in samples of negligible weight do not place a
        # line: the weighted spread of D must be at least half a row.
        b = cov_dt / var_d if var_d > 0.25 * total else -1.0
        a = mean_t - b * mean_d
        if a < 0 or b < 0:  # one batch size, or noise (a shared machine)
            a, b = 0.0, mean_t / mean_d
        # Mixed steps (prefill beside decodes) are the ones the cap governs, and
        # they may cost more than a prefill-only step of as many tokens (a model
        # whose prompt chunks take a slower path). Prefill-only steps count only
        # while no mixed step is known.
        steps = [s for s in self._prefill_steps if s[0] > 0] or self._prefill_steps
        # A step faster than the decode line predicts for its decode rows alone says
        # nothing of its chunk's cost (noise, or a machine that has slowed since: its
        # earlier chunks would look free beside today's line): left out.
        rows = [
            (p, k, r, _recency(newest - i)) for d, p, k, t, i in steps if (r := t - a - b * d) > 0
        ]
        c, e = _nonnegative_fit(rows)
        self._slope = _nonnegative_fit([(p, 0, r, w) for p, _, r, w in rows])[0]
        return a, b, c, e

    def correction(self) -> float:
        """How much longer the latest ``CORRECTION_WINDOW`` mixed steps' prefill part
        took than the fit predicted before each ran (their measured time beyond
        ``a + b * D``, summed, over the predicted ``c * P + e * K``, summed), within
        ``CORRECTION_RANGE``; 1.0 before any. The least-squares fit is unbiased over
        its whole window, not where the cap puts the next chunk: a cost it does not
        model (a chunk's fixed work, threads left idle by a few attention tasks, the
        engine's own work on the same cores) shows as a steady error on the chunks
        the cap picks, and the cap divides its budget by this factor so their
        measured times meet the ratio (output-error feedback, as in model
        predictive control)."""
        predicted = sum(p for p, _ in self._mixed_errors)
        if predicted <= 0:
            return 1.0
        low, high = CORRECTION_RANGE
        return min(high, max(low, sum(m for _, m in self._mixed_errors) / predicted))

    def decode_step_time(self, num_decode_rows: int) -> float | None:
        """Predicted time of a step of ``num_decode_rows`` decodes and no
        prefill (seconds); None while the estimate is not trusted."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, _, _ = fit
        return max(a + b * num_decode_rows, 0.0)

    def max_prefill_tokens(
        self, num_decode_rows: int, itl_ratio: float, num_joining: int = 0, num_computed: int = 0
    ) -> int | None:
        """Most prefill tokens a step with ``num_decode_rows`` decodes may carry
        so that its predicted time is at most ``itl_ratio`` times the
        decode-only step's (``itl_ratio > 1``); None while the estimate is not
        trusted. May be 0: the caller applies its own floor.

        ``num_joining``: requests whose prompts are waiting and will decode
        beside these rows once prefilled. The reference is then the decode-only
        step of ``num_decode_rows + num_joining`` rows, the streams' ITL once they
        have joined: a burst of short prompts beside a few decoding requests is
        admitted in a few steps, not one block a step, while one long prompt
        arriving beside many streams is capped as before.

        ``num_computed``: the prompt tokens before the chunk (its prefix); the
        chunk is charged as one chunk after that many tokens, so a later chunk
        of a long prompt is shorter than its first (the largest root ``n`` of
        ``c * n + e * prefill_context(num_computed, n) = budget``), and none is
        longer than the linear model's (``e = 0``, its ``c`` fitted to the same
        steps) would be."""
        decode_time = self.decode_step_time(num_decode_rows)
        joined_time = self.decode_step_time(num_decode_rows + num_joining)
        fit = self.coefficients()
        if decode_time is None or joined_time is None or fit is None:
            return None
        _, _, c, e = fit
        budget = (itl_ratio * joined_time - decode_time) / self.correction()
        if budget <= 0 or self._slope <= MIN_TOKEN_COST:
            return 0
        # (e / 2) n^2 + (c + e (s + 1/2)) n - budget = 0, in its cancellation-free form.
        linear = c + e * (num_computed + 0.5)
        cap = 2 * budget / (linear + math.sqrt(linear * linear + 2 * e * budget))
        # Never above the linear model's cap (the tokens' slope alone, fitted to the
        # same steps): where the pair extrapolates to a short prefix from noisy
        # steps, the first chunk is not let grow past the chunks of the linear fit.
        return max(0, int(min(cap, budget / self._slope)))


def _recency(age: int) -> float:
    """A sample's weight ``age`` steps after it was observed (``HALF_LIFE_STEPS``)."""
    return 0.5 ** (age / HALF_LIFE_STEPS)


def _nonnegative_fit(rows: list[tuple[int, int, float, float]]) -> tuple[float, float]:
    """``(c, e)`` minimizing ``sum w (r - c * p - e * k)^2`` over ``(p, k, r, w)``: the
    least-squares pair where both parts come out positive and the rows tell the
    columns apart; else the tokens' slope alone (``e = 0``, the linear model). A
    fit of ``e`` alone (``c = 0``) is not taken: it would let a prompt's first
    chunk (no prefix) grow to ``sqrt(2 budget / e)`` tokens on the strength of
    noise. ``c`` is floored at ``MIN_TOKEN_COST``."""
    spp = sum(w * p * p for p, _, _, w in rows)
    skk = sum(w * float(k) * k for _, k, _, w in rows)
    spk = sum(w * float(p) * k for p, k, _, w in rows)
    spr = sum(w * p * r for p, _, r, w in rows)
    skr = sum(w * k * r for _, k, r, w in rows)
    det = spp * skk - spk * spk
    if det > RANK_TOLERANCE * spp * skk:
        c = (skk * spr - spk * skr) / det
        e = (spp * skr - spk * spr) / det
        if c > 0 and e >= 0:
            return c, e
    return max(spr / spp, MIN_TOKEN_COST) if spp > 0 else MIN_TOKEN_COST, 0.0
