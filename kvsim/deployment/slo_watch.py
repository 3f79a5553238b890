"""An early verdict on a fleet replay: once more requests are certainly over a TTFT or TPOT target than the
target's percentile allows, the deployment certainly misses it, and `kvsim plan` stops there.

Why the verdict is certain. The summary's percentiles are numpy's linear ones over the finished requests (TPOT:
those of two or more output tokens), and a deployment meets the SLO only if all N requests finish. Sorted,
x[0] <= .. <= x[N-1], the p99 lies between x[f] and x[f+1] with f = floor(0.99 (N - 1)), so it is at least
x[f]: if N - f requests are over the target T, so is x[f], and so is the p99. The fleet asks at times t when
every row scheduled before t has run (before each row, and before routing each arrival):

- TTFT. A request routed before t whose last prompt chunk was in no row scheduled before t gets its first token
  at the end of a row scheduled at t or later: its TTFT is at least t - arrival, late for good once that is
  over T.
- TPOT. (finished - first token) / (output tokens - 1). The first token comes at the end of the row that
  completes the prompt, and the engine's next key (synchronous: the next row's time) is that end; async, the
  next key is when that row started (the next row is scheduled while it runs), and the one after it is when the
  next row's last step starts, no earlier than that end. That key U bounds the first token from above. A
  request not finished at t (its last output not yet processed) finishes at t or later (async: at the end of
  the row that sampled it, whose successor is not yet scheduled). So its TPOT is at least
  (t - U) / (output tokens - 1), late for good once that is over T.

    arrivals:  a0  a1   a2 ...        t (every row scheduled before t has run)
    served?    y   n    y   n         late: not served and t - arrival > T  ->  TTFT > T, certainly

A request the scheduler rejects never gets a first token and counts as late, rightly: a deployment that leaves
a request unfinished misses anyway (the lower bound is then one had every request finished). `kvsim plan`
replays no deployment whose pool rejects a request at arrival.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

# The margin by which a wait must exceed a target before a request counts as late: far above the rounding of
# numpy's interpolation between two neighbours (a few ulps), far below any latency one would state.
_MARGIN = 1e-9


class SloWatch:
    """Follows a fleet replay (`on_schedule`, given to every replica's engine; `resumed(k, key)`, told each
    time replica k's engine has run a row and yields its next) and says, at a time every row scheduled before it
    has run (`certain_miss(t)`), whether a TTFT or TPOT target is already certainly missed.

    After a miss: `cut_at_s` (the simulated time of the verdict), `metric` (`ttft_p99_s`, ...) and
    `lower_bound`: the percentile is at least this many seconds.
    """

    def __init__(self, targets, arrival_s: np.ndarray, output_tokens: np.ndarray):
        self.arrival = [float(a) for a in arrival_s]
        self.output_tokens = [int(o) for o in output_tokens]  # (num_requests,): each one's, as the summary counts
        n = len(self.arrival)
        num_decoding = sum(o > 1 for o in self.output_tokens)  # the requests TPOT percentiles are over
        self.served = bytearray(n)  # 1 once a row scheduled so far completes the request's prompt
        self.ttft = []  # [metric, target, needed, next request to look at, [(request, lower bound)]]
        self.tpot = []  # [metric, target, needed, heap of (late from, request, seq, U), [(request, lower bound)]]
        for metric, bound in targets:
            kind, q = metric[:4], int(metric[len("ttft_p"):-len("_s")])
            if kind == "ttft":
                self.ttft.append([metric, float(bound), n - _lowest_index(q, n), 0, []])
            elif kind == "tpot" and num_decoding:
                self.tpot.append([metric, float(bound), num_decoding - _lowest_index(q, num_decoding), [], []])
        self._fresh: list = []  # prompts completed in the row running now (synchronous engines)
        self._fresh_async: list = []  # the same, async engines: U is the key after the next
        self._completed: dict[int, list] = {}  # per async replica: prompts completed in its last row
        self.cut_at_s: float | None = None
        self.metric: str | None = None
        self.lower_bound: float | None = None

    @property
    def active(self) -> bool:
        return bool(self.ttft or self.tpot)

    def on_schedule(self, out, sched) -> None:
        """A row was scheduled: the requests whose last prompt chunk it holds for the first time get their first
        token at its end (the replay's own rule for first_token_s)."""
        served = self.served
        for seq, start, num in out.prefills:
            if start + num >= seq.num_prompt_tokens and not served[seq.index]:
                served[seq.index] = 1
                if self.tpot and self.output_tokens[seq.index] > 1:
                    (self._fresh_async if sched.async_scheduling else self._fresh).append(seq)

    def resumed(self, k: int, key: float) -> None:
        """Replica k's engine ran a row (or an empty round) and will schedule its next at `key`: the first token
        of a prompt completed the row before came no later than `key` (see the module's docstring)."""
        if not self.tpot:
            return
        bounded = self._fresh + self._completed.pop(k, [])
        if self._fresh_async:
            self._completed[k] = self._fresh_async
        self._fresh, self._fresh_async = [], []
        if key == math.inf:
            return  # idle: what it completed has finished (requests of one output token are never listed)
        for seq in bounded:
            decodes = self.output_tokens[seq.index] - 1
            for check in self.tpot:
                heapq.heappush(check[3], (key + check[1] * decodes * (1 + _MARGIN), seq.index, seq, key))

    def certain_miss(self, t: float) -> bool:
        """True once, at time `t` (every row scheduled before `t` has run), some target is certainly missed."""
        arrival, served = self.arrival, self.served
        n = len(arrival)
        for check in self.ttft:
            metric, bound, needed, p, late = check
            limit = bound * (1 + _MARGIN)
            while p < n and t - arrival[p] > limit:
                if not served[p]:
                    late.append((p, t - arrival[p]))
                p += 1
            check[3] = p
            if len(late) >= needed:  # a late request still unserved now waits until t at least
                return self._miss(t, metric, needed, [t - arrival[j] if not served[j] else w for j, w in late])
        for metric, bound, needed, heap, late in self.tpot:
            while heap and heap[0][0] < t:
                _, j, seq, first_by = heapq.heappop(heap)
                if seq.num_output_tokens < seq.max_tokens:  # not finished: it finishes at t or later
                    late.append((j, (t - first_by) / (self.output_tokens[j] - 1)))
            if len(late) >= needed:
                return self._miss(t, metric, needed, [w for _, w in late])
        return False

    def _miss(self, t: float, metric: str, needed: int, waits: list[float]) -> bool:
        self.cut_at_s, self.metric = t, metric
        self.lower_bound = sorted(waits, reverse=True)[needed - 1]
        return True


def _lowest_index(q: int, n: int) -> int:
    """The sorted index the q-th percentile of n values is at least (numpy's linear method: floor(q/100 (n-1))),
    one lower when q/100 (n-1) is whole, so that float rounding of the position can only make the verdict later
    (the position's fraction is a multiple of 1/100 otherwise, far from the tolerance)."""
    return max(math.ceil(q / 100 * (n - 1) - 1e-6) - 1, 0)
