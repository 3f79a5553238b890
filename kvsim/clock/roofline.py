"""The simulated step time: a roofline of one GPU, so a replay's clock is deterministic and host-independent.

A step (one forward pass over the batch the scheduler built) costs the larger of its compute time and its
memory time:

    compute_s = (2 * num_params * num_tokens + attn_flops_per_ctx * attended_ctx) / peak_flops
    memory_s  = (weight_bytes + kv_bytes_per_token * (kv_read_tokens + num_tokens)
                 + swap_bytes * hbm_bw / host_bw) / hbm_bw
    comm_s    = num_allreduces * (2 * (tp - 1) / tp) * num_tokens * hidden_size * 2 / link_bw
    step_s    = max(compute_s, memory_s) + comm_s

- `num_tokens`: prompt tokens of prefill chunks plus one per decoding request (each is computed once and its
  K/V written once).
- `attended_ctx`: sum over computed tokens of how many positions each attends to (a decode token at
  position c attends to c + 1; a causal chunk of n tokens starting at s attends to n*s + n*(n+1)/2).
  `attn_flops_per_ctx = 4 * num_attention_layers * num_attention_heads * head_dim` (QK^T and PV, 2 FLOPs per
  multiply-add).
- `kv_read_tokens`: the whole context of every request in the batch, read once per step (flash-style).
- `swap_bytes` (preemption by swapping) cross the host link at `host_bandwidth_bytes_per_s`.
Decode is therefore bandwidth-bound (weights + live KV at HBM bandwidth) and large prefills FLOP-bound.
Peak figures are used as they are (no efficiency factor): the clock is an optimistic, comparable bound.

At `tp` tensor-parallel ranks the figures are one rank's: weights, parameters and attention heads divided by tp
(KV bytes per token as `kvsim size --tp` counts them: split or replicated heads), plus the all-reduces vLLM's
row-parallel layers run on the critical path (`comm_s`): two per decoder layer (after attention's o_proj and the
MLP's or MoE's down projection) and one for the vocab-parallel embedding, each of the step's tokens' 16-bit
hidden states, as a ring moves them (2(tp-1)/tp of the bytes through each GPU's link, one direction's peak from
kvsim/models/data/interconnect.yaml; no latency term, so small decode all-reduces come out optimistic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# PCIe Gen5 x16 in one direction, what H100/H200 SXM boards attach with: swap traffic crosses it.
HOST_BANDWIDTH_BYTES_PER_S = 64e9
ACTIVATION_BYTES = 2  # the hidden states tensor parallelism all-reduces: 16-bit activations


@dataclass(frozen=True)
class Roofline:
    """Step-time model of one GPU serving one model; see the module docstring for the formula."""

    weight_bytes: float
    num_params: float
    kv_bytes_per_token: float
    attn_flops_per_ctx: float
    hbm_bandwidth_bytes_per_s: float
    peak_flops: float
    host_bandwidth_bytes_per_s: float = HOST_BANDWIDTH_BYTES_PER_S
    comm_s_per_token: float = 0.0  # tp > 1: the step's all-reduces, seconds per token of the step
    tp: int = 1

    def __post_init__(self) -> None:
        assert self.hbm_bandwidth_bytes_per_s > 0 and self.peak_flops > 0
        assert self.weight_bytes >= 0 and self.num_params >= 0 and self.kv_bytes_per_token >= 0
        assert self.comm_s_per_token >= 0 and self.tp >= 1

    @classmethod
    def for_model(cls, model, gpu, *, weight_bytes: float, kv_bytes_per_token: float, tp: int = 1) -> "Roofline":
        """From a catalogue `ModelSpec`, a `GPUSpec` and the sizes `kvsim.size.sizing` computed for them, at `tp`
        ranks: `weight_bytes` and `kv_bytes_per_token` are one rank's (`weight_bytes(model, tp=tp)`,
        `kv_cache_spec(model, tp=tp)`)."""
        attention_layers = len(model.attention_layers)
        heads_per_rank = model.num_attention_heads / tp  # kv_cache_spec has checked that tp divides them
        attn = 4.0 * attention_layers * heads_per_rank * max(model.head_dim, 0)
        # Without a parameter count, the weights' bytes at 2 bytes per parameter are the best guess.
        num_params = model.num_params / tp if model.num_params else weight_bytes / 2
        comm = 0.0
        if tp > 1:
            from kvsim.models.interconnect import get_interconnect

            num_allreduces = 2 * model.num_layers + 1
            ring = 2.0 * (tp - 1) / tp
            comm = num_allreduces * ring * model.hidden_size * ACTIVATION_BYTES / get_interconnect(gpu).bandwidth_bytes_per_s
        return cls(
            weight_bytes=float(weight_bytes),
            num_params=float(num_params),
            kv_bytes_per_token=float(kv_bytes_per_token),
            attn_flops_per_ctx=attn,
            hbm_bandwidth_bytes_per_s=float(gpu.hbm_bandwidth_bytes_per_s),
            peak_flops=float(gpu.bf16_flops_per_s),
            comm_s_per_token=comm,
            tp=tp,
        )

    def step_time(self, num_tokens: int, attended_ctx: int, kv_read_tokens: int, swap_bytes: int = 0) -> float:
        """Seconds of one step (the formula in the module docstring)."""
        compute = (2.0 * self.num_params * num_tokens + self.attn_flops_per_ctx * attended_ctx) / self.peak_flops
        memory = (
            self.weight_bytes + self.kv_bytes_per_token * (kv_read_tokens + num_tokens)
        ) / self.hbm_bandwidth_bytes_per_s + swap_bytes / self.host_bandwidth_bytes_per_s
        return (compute if compute > memory else memory) + self.comm_s_per_token * num_tokens

    def decode_run(self, num_seqs: int, ctx_sum: int, num_steps: int) -> float:
        """Seconds of `num_steps` decode-only steps of the same `num_seqs` requests, in closed form.

        `ctx_sum` is the sum of the requests' computed tokens before the first step; every step adds one token
        to each, so step j attends to and reads `ctx_sum + num_seqs * (j + 1)` positions and writes `num_seqs`.
        Compute and memory time are both linear in j, so their max crosses over at most once.
        """
        assert num_seqs > 0 and num_steps >= 0
        n = float(num_seqs)
        bw, flops, bpt, attn = self.hbm_bandwidth_bytes_per_s, self.peak_flops, self.kv_bytes_per_token, self.attn_flops_per_ctx
        ctx0 = ctx_sum + n  # attended context of step 0
        a_m, b_m = (self.weight_bytes + bpt * (ctx0 + n)) / bw, bpt * n / bw
        a_c, b_c = (2.0 * self.num_params * n + attn * ctx0) / flops, attn * n / flops
        # Steps in [lo, hi) are compute-bound: d + e*j > 0.
        d, e = a_c - a_m, b_c - b_m
        if e == 0:
            lo, hi = (0, num_steps) if d > 0 else (0, 0)
        elif e > 0:
            lo, hi = min(num_steps, max(0, math.floor(-d / e) + 1)), num_steps
        else:
            lo, hi = 0, min(num_steps, max(0, math.ceil(-d / e)))
        total = _linear_sum(a_m, b_m, 0, num_steps)
        if hi > lo:
            total += _linear_sum(a_c - a_m, b_c - b_m, lo, hi)
        return total + num_steps * self.comm_s_per_token * n

    def decode_steps_before(self, num_seqs: int, ctx_sum: int, max_steps: int, time_left: float) -> tuple[int, float]:
        """How many decode steps (at least 1, at most `max_steps`) start before `time_left` s, and their total time.

        A request arriving at `now + time_left` is admitted at the first step that starts at or after it, so a
        run of decode steps may only cover steps that start strictly before (a binary search over `decode_run`).
        """
        assert max_steps >= 1
        # Steps only get longer, so no more than ceil(time_left / first step) of them start in time.
        first = self.decode_run(num_seqs, ctx_sum, 1)
        if time_left < math.inf:
            max_steps = max(1, min(max_steps, math.ceil(time_left / first)))
        lo, hi = 1, max_steps  # step 0 always runs; find the largest k whose last step starts in time
        if self.decode_run(num_seqs, ctx_sum, hi - 1) < time_left:
            lo = hi
        return last_step_before(self.decode_run, num_seqs, ctx_sum, lo, hi, time_left)


def last_step_before(decode_run, num_seqs: int, ctx_sum: int, lo: int, hi: int, time_left: float) -> tuple[int, float]:
    """The largest k in [lo, hi] whose k-th decode step starts before `time_left` s (it starts after
    `decode_run(num_seqs, ctx_sum, k - 1)`), found by bisection as step times only grow, and k steps' time."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_run(num_seqs, ctx_sum, mid - 1) < time_left:
            lo = mid
        else:
            hi = mid - 1
    return lo, decode_run(num_seqs, ctx_sum, lo)


def _linear_sum(a: float, b: float, j0: int, j1: int) -> float:
    """Sum of a + b*j for j in [j0, j1)."""
    count = j1 - j0
    return count * a + b * (count * (j0 + j1 - 1) / 2.0)
