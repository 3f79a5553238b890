"""Random request lengths and arrival times for synthetic workloads, drawn from numpy Generators.

Every draw takes the caller's `np.random.Generator`, so one workload seed fixes the whole request stream.
The `*_from_fields` functions read the YAML form (`{dist: lognormal, mean: 512, sigma: 0.8}`) through
`kvsim.workload.yaml_fields.Fields`, which names the file and field in every error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from kvsim.errors import KvsimError

if TYPE_CHECKING:
    from kvsim.workload.yaml_fields import Fields

LengthKind = Literal["constant", "uniform", "normal", "lognormal", "zipf", "empirical"]
ArrivalKind = Literal["poisson", "gamma", "constant", "burst"]
LENGTH_KINDS = ("constant", "uniform", "normal", "lognormal", "zipf", "empirical")
ARRIVAL_KINDS = ("poisson", "gamma", "constant", "burst")
# The longest request kvsim draws or reads (prompt or output tokens): beyond any model's context (10M for the
# longest today), and small enough that counts stay exact int64 and a bounded zipf's table stays ~100 MiB.
MAX_TOKENS = 2**24
# The latest arrival kvsim replays, in seconds from the first (~32 years). A double resolves times there to 1.2e-7 s,
# well under a step's time; a rate of 1e-15 requests/s put arrivals near 1e16 s, where the resolution is 2 s and
# every TTFT and TPOT read 0 (the arrival swallowed the steps' times). Traces are held to it too.
MAX_ARRIVAL_S = 1e9


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts (prompt or output), drawn then rounded and clipped to [min, max].

    - constant {value}; uniform {min, max} (both inclusive, every integer equally likely);
    - normal {mean, std};
    - lognormal {mean, sigma}: `mean` is the mean of the *lengths* (not of the underlying normal), so
      `{mean: 512, sigma: 0.8}` gives lengths averaging about 512 before clipping; the underlying normal
      has mu = ln(mean) - sigma**2 / 2 and standard deviation sigma;
    - zipf {exponent, min, max}: P(min + k - 1) proportional to k**-exponent for k = 1 .. max - min + 1
      (bounded, so any exponent > 0 works and no mass piles up at max);
    - empirical {values, weights} or {file}: lengths drawn from the given values (weights default equal).
    """

    dist: LengthKind
    min: int = 1
    max: int | None = None
    value: int | None = None  # constant
    mean: float | None = None  # normal, lognormal
    std: float | None = None  # normal
    sigma: float | None = None  # lognormal
    exponent: float | None = None  # zipf
    values: tuple[int, ...] = ()  # empirical
    weights: tuple[float, ...] = ()  # empirical, same length as values

    def __post_init__(self) -> None:
        assert self.dist in LENGTH_KINDS, self.dist
        assert self.min >= 0 and (self.max is None or self.max >= self.min)
        assert self.dist not in ("uniform", "zipf") or self.max is not None
        assert self.dist != "empirical" or (len(self.values) == len(self.weights) > 0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths, (n,) int64, each in [min, max]."""
        if self.dist == "constant":
            raw = np.full(n, float(self.value))
        elif self.dist == "uniform":
            raw = rng.integers(self.min, self.max, size=n, endpoint=True).astype(np.float64)
        elif self.dist == "normal":
            raw = rng.normal(self.mean, self.std, size=n)
        elif self.dist == "lognormal":
            mu = np.log(self.mean) - self.sigma**2 / 2  # so that E[length] = mean
            raw = rng.lognormal(mu, self.sigma, size=n)
        elif self.dist == "zipf":
            ranks = np.arange(1, self.max - self.min + 2, dtype=np.float64)  # (support,)
            cdf = np.cumsum(ranks**-self.exponent)
            idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")  # (n,) 0-based rank
            raw = (self.min + np.minimum(idx, len(ranks) - 1)).astype(np.float64)
        else:  # empirical
            p = np.asarray(self.weights, dtype=np.float64)
            raw = rng.choice(np.asarray(self.values, dtype=np.float64), size=n, p=p / p.sum())
        upper = MAX_TOKENS if self.max is None else self.max  # unbounded tails stop at MAX_TOKENS
        return np.clip(np.rint(raw), self.min, upper).astype(np.int64)


@dataclass(frozen=True)
class ArrivalProcess:
    """When requests arrive, in seconds from the first (which arrives at t = 0).

    - poisson {rate}: exponential gaps with mean 1/rate (requests per second);
    - gamma {rate, cv}: gamma gaps with mean 1/rate and coefficient of variation cv (cv > 1 is burstier
      than Poisson, cv < 1 smoother, cv = 1 is Poisson);
    - constant {rate}: one request every 1/rate seconds;
    - burst {size, every_s}: `size` requests at once, every `every_s` seconds.
    """

    process: ArrivalKind
    rate: float | None = None
    cv: float = 1.0
    size: int = 1
    every_s: float | None = None

    def __post_init__(self) -> None:
        assert self.process in ARRIVAL_KINDS, self.process
        assert self.process == "burst" or (self.rate is not None and self.rate > 0)
        assert self.process != "burst" or (self.every_s is not None and self.every_s > 0 and self.size >= 1)

    @property
    def mean_rate(self) -> float:
        """Requests per second in the long run."""
        return self.size / self.every_s if self.process == "burst" else self.rate

    def expected_last_arrival(self, count: int) -> float:
        """When the last of `count` requests arrives, in seconds: exact for constant and burst, the mean for
        poisson and gamma."""
        if self.process == "burst":
            return (count - 1) // self.size * self.every_s
        return (count - 1) / self.rate

    def times(self, rng: np.random.Generator, *, count: int | None = None, duration_s: float | None = None) -> np.ndarray:
        """Non-decreasing arrival times, (n,) float64: exactly `count` of them, or all before `duration_s`."""
        assert (count is None) != (duration_s is None)
        if self.process in ("constant", "burst"):  # deterministic: request i at a fixed time
            n = count if count is not None else int(np.ceil(duration_s * self.mean_rate)) + self.size
            index = np.arange(n)
            times = index / self.rate if self.process == "constant" else (index // self.size) * self.every_s
        elif count is not None:
            times = np.concatenate(([0.0], np.cumsum(self._gaps(rng, max(count - 1, 0)))))
        else:
            expected = duration_s * self.mean_rate
            chunk = int(expected + 6 * np.sqrt(expected) + 16)
            times = np.concatenate(([0.0], np.cumsum(self._gaps(rng, chunk))))
            while times[-1] < duration_s:  # rare: the first chunk fell short, draw more
                times = np.concatenate((times, times[-1] + np.cumsum(self._gaps(rng, chunk))))
        return times[:count] if count is not None else times[times < duration_s]

    def _gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` random inter-arrival gaps in seconds, (n,) float64 (poisson and gamma only)."""
        if self.process == "poisson":
            return rng.exponential(1.0 / self.rate, size=n)
        shape = 1.0 / self.cv**2  # gamma(k, theta): mean k*theta = 1/rate, cv = 1/sqrt(k)
        return rng.gamma(shape, 1.0 / (self.rate * shape), size=n)


def length_from_fields(f: Fields, *, base_dir: Path) -> LengthDistribution:
    """Read `{dist: ..., ...}` (one mapping of the workload YAML) into a LengthDistribution."""
    dist = f.choice("dist", LENGTH_KINDS)
    needs_max = dist in ("uniform", "zipf")
    lo = f.int("min", 1, min=1, max=MAX_TOKENS)
    hi = f.int("max", min=lo, max=MAX_TOKENS) if needs_max else f.int("max", None, min=lo, max=MAX_TOKENS)
    kw: dict = {}
    if dist == "constant":
        kw["value"] = f.int("value", min=lo, max=MAX_TOKENS)
        if hi is not None and kw["value"] > hi:
            raise f.error("value", f"must be <= max ({hi}), got {kw['value']}")
    elif dist == "normal":
        kw["mean"] = f.float("mean", min=0, exclusive=True)
        kw["std"] = f.float("std", min=0)
    elif dist == "lognormal":
        kw["mean"] = f.float("mean", min=0, exclusive=True)
        kw["sigma"] = f.float("sigma", min=0)
    elif dist == "zipf":
        kw["exponent"] = f.float("exponent", min=0, exclusive=True)
    elif dist == "empirical":
        kw["values"], kw["weights"] = _empirical(f, base_dir)
    f.done()
    return LengthDistribution(dist, min=lo, max=hi, **kw)


def _empirical(f: Fields, base_dir: Path) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """`values` (+ optional `weights`) inline, or `file`: one length per line, or `length,weight` per line."""
    if f.has("file") == f.has("values"):
        raise f.error("values", "give exactly one of 'values' (a list) or 'file' (a path)")
    if f.has("values"):
        values = f.int_list("values", min=1, max=MAX_TOKENS)
        weights = f.float_list("weights", min=0) if f.has("weights") else [1.0] * len(values)
        if len(weights) != len(values):
            raise f.error("weights", f"has {len(weights)} entries but values has {len(values)}")
    else:
        path = base_dir / f.str("file")
        values, weights = _read_lengths_file(path)
    if sum(weights) <= 0:
        raise f.error("weights", "must not all be zero")
    return tuple(values), tuple(weights)


def _read_lengths_file(path: Path) -> tuple[list[int], list[float]]:
    """Parse a lengths file; '#' starts a comment. Errors name the file and line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise KvsimError(f"cannot read lengths file: {exc.strerror or exc}", source=str(path)) from None
    values: list[int] = []
    weights: list[float] = []
    for lineno, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = [p.strip() for p in text.split(",")]
        try:
            value = int(parts[0])
            weight = float(parts[1]) if len(parts) == 2 else 1.0
            ok = len(parts) <= 2 and 1 <= value <= MAX_TOKENS and 0 <= weight < float("inf")
        except ValueError:
            ok = False
        if not ok:
            raise KvsimError(f"expected 'length' or 'length,weight' (1 <= length <= {MAX_TOKENS:,}), got {line!r}", source=str(path), field=f"line {lineno}")
        values.append(value)
        weights.append(weight)
    if not values:
        raise KvsimError("no lengths in file", source=str(path))
    return values, weights


def arrival_from_fields(f: Fields, *, count: int | None = None) -> ArrivalProcess:
    """Read `{process: poisson, rate: 10.0}` (or gamma / constant / burst) into an ArrivalProcess; with `count`,
    its last arrival (the mean, for a random process) must come by MAX_ARRIVAL_S."""
    process = f.choice("process", ARRIVAL_KINDS)
    if process == "burst":
        result = ArrivalProcess("burst", size=f.int("size", min=1), every_s=f.float("every_s", min=0, exclusive=True))
        key, given, second = "every_s", f"{result.every_s:g} s", "burst"
        first = result.every_s  # the second burst's arrival
    else:
        rate = f.float("rate", min=0, exclusive=True)
        # cv**2 must stay a normal float: a cv of 1e-300 made the gamma shape 1 / 0 (a ZeroDivisionError)
        cv = f.float("cv", min=1e-6, max=1e6) if process == "gamma" else 1.0
        result = ArrivalProcess(process, rate=rate, cv=cv)
        key, given, second = "rate", f"{rate:g} requests/s", "request"
        first = 1 / rate  # the second request's (mean) arrival
    # rate 1e-307 and every_s 1e307 overflowed the arrival times (a traceback), and rate 1e-15 put them near 1e16 s,
    # where every TTFT and TPOT read 0
    if first > MAX_ARRIVAL_S:
        raise f.error(key, f"{given} puts the second {second} at {first:.3g} s, {_PAST_LATEST}")
    last = result.expected_last_arrival(count) if count is not None else 0.0
    if last > MAX_ARRIVAL_S:
        mean = "" if process in ("constant", "burst") else " on average"
        raise f.error(key, f"{given} puts the last of {count:,} requests at {last:.3g} s{mean}, {_PAST_LATEST}")
    f.done()
    return result


_PAST_LATEST = f"past {MAX_ARRIVAL_S:g} s, the latest arrival kvsim replays (beyond it a double does not resolve a step's time)"
