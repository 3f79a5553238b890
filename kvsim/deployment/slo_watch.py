"""An early verdict on a fleet replay: once more requests have waited past a TTFT target without their first
token than the target's percentile allows, the deployment certainly misses it, and `kvsim plan` stops there.

Why the verdict is certain. The summary's p99 TTFT is numpy's linear percentile over every finished request,
and a deployment meets the SLO only if all N requests finish. Sorted, x[0] <= .. <= x[N-1], the p99 lies
between x[f] and x[f+1] with f = floor(0.99 (N - 1)), so it is at least x[f]: if N - f requests have a TTFT
over the target T, so has x[f], and so has the p99. A request routed before t whose last prompt chunk was not
in a row scheduled before t gets its first token at the end of a row scheduled at t or later, so its TTFT is at
least t - arrival: once that exceeds T it is late for good, whatever the rest of the replay does. (A request
the scheduler rejects never gets one either: it counts as late, and rightly, since a deployment that leaves a
request unfinished misses anyway; the lower bound below is then one on the p99 had every request finished.
`kvsim plan` replays no deployment whose pool rejects a request at arrival.)

    arrivals:  a0  a1   a2 ...        t (every row scheduled before t has run)
    served?    y   n    y   n         late: not served and t - arrival > T  ->  TTFT > T, certainly
"""

from __future__ import annotations

import math

import numpy as np

# The margin by which t - arrival must exceed a target before a request counts as late: far above the rounding
# of numpy's interpolation between two neighbours (a few ulps), far below any latency one would state.
_MARGIN = 1e-9


class SloWatch:
    """Follows a fleet replay row by row (`on_schedule`, given to every replica's engine) and says, at a time
    every row scheduled before it has run (`certain_miss(t)`), whether a TTFT target is already missed.

    After a miss: `cut_at_s` (the simulated time of the verdict), `metric` (`ttft_p99_s`), and `lower_bound`:
    the percentile is at least this many seconds (the smallest of the late requests' waits that the percentile
    must be at least, as above).
    """

    def __init__(self, targets, arrival_s: np.ndarray):
        self.arrival = [float(a) for a in arrival_s]
        n = len(self.arrival)
        self.served = bytearray(n)  # 1 once a row scheduled so far completes the request's prompt
        self.checks = []  # [metric, target, needed, next request to look at, [(request, when found late)]]
        for metric, bound in targets:
            if metric.startswith("ttft_p"):
                q = int(metric[len("ttft_p"):-len("_s")])
                self.checks.append([metric, float(bound), n - _lowest_index(q, n), 0, []])
        self.cut_at_s: float | None = None
        self.metric: str | None = None
        self.lower_bound: float | None = None

    @property
    def active(self) -> bool:
        return bool(self.checks)

    def on_schedule(self, out, sched) -> None:
        """A row was scheduled: the requests whose last prompt chunk it holds get their first token at its end
        (the replay's own rule for first_token_s)."""
        served = self.served
        for seq, start, num in out.prefills:
            if start + num >= seq.num_prompt_tokens:
                served[seq.index] = 1

    def certain_miss(self, t: float) -> bool:
        """True once, at time `t` (every row scheduled before `t` has run), some TTFT target is certainly missed."""
        arrival, served = self.arrival, self.served
        n = len(arrival)
        for check in self.checks:
            metric, bound, needed, p, late = check
            limit = bound * (1 + _MARGIN)
            while p < n and t - arrival[p] > limit:
                if not served[p]:
                    late.append((p, t))
                p += 1
            check[3] = p
            if len(late) >= needed:
                self.cut_at_s, self.metric = t, metric
                # Each late request waits at least until it was found late, or until t if still not served.
                waits = sorted(((t if not served[j] else found) - arrival[j] for j, found in late), reverse=True)
                self.lower_bound = waits[needed - 1]
                return True
        return False


def _lowest_index(q: int, n: int) -> int:
    """The sorted index the q-th percentile of n values is at least (numpy's linear method: floor(q/100 (n-1))),
    one lower when q/100 (n-1) is whole, so that float rounding of the position can only make the verdict later
    (the position's fraction is a multiple of 1/100 otherwise, far from the tolerance)."""
    return max(math.ceil(q / 100 * (n - 1) - 1e-6) - 1, 0)
