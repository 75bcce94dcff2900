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

The estimate is linear in the step's shape (the worker's time: forward plus
sampling, ``ModelRunnerOutput``)::

    t(D, P) = a + b * D + c * P

``D``: decode rows (requests given their next token, with any drafts), ``P``:
prefill tokens (prompt chunks, recomputation after a preemption, drafts).
``a`` and ``b`` are the least-squares line through the last ``window``
decode-only steps, ``c`` the least-squares slope through the origin of the
last ``window`` prefill steps' time beyond ``a + b * D``. Decode-only and
prefill steps are kept apart so a long run of either does not push the other
out of the window. A mixed step may also pay a cost per step (where the
model runs prompt chunks on a slower path than decode rows; on the CPU the
fused C++ layers take both), which the slope through the origin charges to
its tokens: at a steady chunk size that is exact, and the cap settles where
the step's whole time meets the ratio; the slope is fitted to mixed steps
only once there are any. Where the decode-only steps cannot place the
line (all of one batch size, or a fit with a negative part) it goes through
the origin (``a = 0``): that errs toward a smaller cap, never a longer step,
as it charges the intercept of a prefill-only step to its tokens and predicts
less time, not more, for a smaller batch.
"""

from __future__ import annotations

import math
from collections import deque

# Below this many samples of each kind the estimate is not trusted (None).
MIN_SAMPLES = 1


class StepCostModel:
    """Running estimate of a step's time from its decode rows and prefill tokens.

    Args:
        window: steps of each kind (decode-only, with prefill) the fit uses.

    Raises:
        ValueError: ``window`` below ``MIN_SAMPLES``.
    """

    def __init__(self, window: int = 64) -> None:
        if window < MIN_SAMPLES:
            raise ValueError(f"window must be >= {MIN_SAMPLES}, got {window}")
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._prefill_steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float] | None = None
        self._stale = False

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, step_time: float) -> None:
        """Record one step the worker ran: its shape and its time in seconds. A time
        that is not a positive finite number (no time reported, a clock that went
        back, NaN or inf from a worker) is ignored: one would poison the window's
        fit, and the scheduler's cap with it, for ``window`` steps."""
        if not 0 < step_time < math.inf or num_decode_rows + num_prefill_tokens <= 0:
            return  # an empty step, or a worker that reports no usable time
        if num_prefill_tokens:
            self._prefill_steps.append((num_decode_rows, num_prefill_tokens, step_time))
        else:
            self._decode_steps.append((num_decode_rows, step_time))
        self._stale = True

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` in seconds, seconds per decode row, seconds per prefill
        token; None until ``MIN_SAMPLES`` steps of each kind were observed."""
        if self._stale:
            self._fit = self._refit()
            self._stale = False
        return self._fit

    def _refit(self) -> tuple[float, float, float] | None:
        if len(self._decode_steps) < MIN_SAMPLES or len(self._prefill_steps) < MIN_SAMPLES:
            return None
        n = len(self._decode_steps)
        mean_d = sum(d for d, _ in self._decode_steps) / n
        mean_t = sum(t for _, t in self._decode_steps) / n
        var_d = sum((d - mean_d) ** 2 for d, _ in self._decode_steps)
        cov_dt = sum((d - mean_d) * (t - mean_t) for d, t in self._decode_steps)
        b = cov_dt / var_d if var_d > 0 else -1.0
        a = mean_t - b * mean_d
        if a < 0 or b < 0:  # one batch size, or noise (a shared machine)
            a, b = 0.0, mean_t / mean_d
        # Mixed steps (prefill beside decodes) are the ones the cap governs, and
        # they may cost more than a prefill-only step of as many tokens (a model
        # whose prompt chunks take a slower path). Prefill-only steps count only
        # while no mixed step is known.
        steps = [s for s in self._prefill_steps if s[0] > 0] or self._prefill_steps
        num = sum(p * (t - a - b * d) for d, p, t in steps)
        den = sum(p * p for _, p, _ in steps)
        # A prefill token always costs something; the floor keeps the cap finite
        # when noise (a shared machine) makes the slope come out at or below 0.
        c = max(num / den, 1e-9)
        return a, b, c

    def decode_step_time(self, num_decode_rows: int) -> float | None:
        """Predicted time of a step of ``num_decode_rows`` decodes and no
        prefill (seconds); None while the estimate is not trusted."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, _ = fit
        return max(a + b * num_decode_rows, 0.0)

    def max_prefill_tokens(self, num_decode_rows: int, itl_ratio: float,
                           num_joining: int = 0) -> int | None:
        """Most prefill tokens a step with ``num_decode_rows`` decodes may carry
        so that its predicted time is at most ``itl_ratio`` times the
        decode-only step's (``itl_ratio > 1``); None while the estimate is not
        trusted. May be 0: the caller applies its own floor.

        ``num_joining``: requests whose prompts are waiting and will decode
        beside these rows once prefilled. The reference is then the decode-only
        step of ``num_decode_rows + num_joining`` rows, the streams' ITL once they
        have joined: a burst of short prompts beside a few decoding requests is
        admitted in a few steps, not one block a step, while one long prompt
        arriving beside many streams is capped as before."""
        decode_time = self.decode_step_time(num_decode_rows)
        joined_time = self.decode_step_time(num_decode_rows + num_joining)
        fit = self.coefficients()
        if decode_time is None or joined_time is None or fit is None:
            return None
        return max(0, int((itl_ratio * joined_time - decode_time) / fit[2]))
