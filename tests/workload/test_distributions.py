"""Length distributions and arrival processes: means, clipping, shapes and determinism."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.workload.distributions import ArrivalProcess, LengthDistribution

N = 200_000


def draw(dist: LengthDistribution, seed: int = 0, n: int = N) -> np.ndarray:
    return dist.sample(np.random.default_rng(seed), n)


def test_lognormal_mean_is_the_mean_of_the_lengths():
    # The example: mean 512, sigma 0.8 -> lengths averaging ~512 (clipping at 3072 trims ~0.5%).
    x = draw(LengthDistribution("lognormal", mean=512, sigma=0.8, min=8, max=3072))
    assert x.dtype == np.int64
    assert 500 < x.mean() < 515
    # Median of a lognormal is exp(mu) = mean * exp(-sigma^2 / 2) = 512 * e^-0.32 = 371.8
    assert abs(np.median(x) - 371.8) < 5


def test_lognormal_unclipped_mean_matches():
    x = draw(LengthDistribution("lognormal", mean=100, sigma=0.5))
    assert abs(x.mean() - 100) < 1.0


@pytest.mark.parametrize(
    "dist",
    [
        LengthDistribution("lognormal", mean=512, sigma=1.5, min=8, max=3072),
        LengthDistribution("normal", mean=100, std=80, min=10, max=150),
        LengthDistribution("zipf", exponent=1.1, min=5, max=50),
        LengthDistribution("uniform", min=16, max=1024),
        LengthDistribution("empirical", values=(1, 5, 5000), weights=(1, 1, 1), min=2, max=1000),
    ],
)
def test_every_length_is_clipped_to_min_and_max(dist):
    x = draw(dist, n=20_000)
    assert x.min() >= dist.min and x.max() <= dist.max
    # Clipping really happened at the edges for the wide ones (mass piles at the bounds, nothing beyond).
    if dist.dist in ("normal", "empirical"):
        assert (x == dist.min).any() and (x == dist.max).any()


def test_uniform_is_inclusive_and_flat():
    x = draw(LengthDistribution("uniform", min=16, max=1024))
    assert x.min() == 16 and x.max() == 1024
    assert abs(x.mean() - 520) < 3  # (16 + 1024) / 2
    small = draw(LengthDistribution("uniform", min=1, max=4))
    counts = np.bincount(small)[1:]
    assert len(counts) == 4 and np.all(np.abs(counts / N - 0.25) < 0.01)


def test_normal_mean_and_std():
    x = draw(LengthDistribution("normal", mean=300, std=50))
    assert abs(x.mean() - 300) < 1 and abs(x.std() - 50) < 1


def test_constant():
    assert np.array_equal(draw(LengthDistribution("constant", value=77), n=5), [77] * 5)


def test_zipf_probabilities_follow_the_power_law():
    x = draw(LengthDistribution("zipf", exponent=1.0, min=10, max=13))
    # P(k) = k^-1 / (1 + 1/2 + 1/3 + 1/4) for k = 1..4, at lengths 10..13
    expected = np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12)
    observed = np.bincount(x - 10, minlength=4) / N
    assert np.allclose(observed, expected, atol=0.005)


def test_empirical_follows_weights():
    x = draw(LengthDistribution("empirical", values=(10, 20, 30), weights=(1, 0, 3)))
    assert set(np.unique(x)) == {10, 30}
    assert abs((x == 30).mean() - 0.75) < 0.01


def test_same_generator_seed_same_lengths():
    d = LengthDistribution("lognormal", mean=512, sigma=0.8)
    assert np.array_equal(draw(d, seed=3, n=100), draw(d, seed=3, n=100))
    assert not np.array_equal(draw(d, seed=3, n=100), draw(d, seed=4, n=100))


def times(process: ArrivalProcess, seed: int = 0, **kw) -> np.ndarray:
    return process.times(np.random.default_rng(seed), **kw)


def test_poisson_gaps_are_exponential_with_mean_one_over_rate():
    t = times(ArrivalProcess("poisson", rate=10.0), count=N)
    gaps = np.diff(t)
    assert t[0] == 0.0 and len(t) == N and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.1) < 0.001
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.02  # cv of an exponential is 1


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_gaps_have_the_requested_rate_and_cv(cv):
    gaps = np.diff(times(ArrivalProcess("gamma", rate=5.0, cv=cv), count=N))
    assert abs(gaps.mean() - 0.2) / 0.2 < 0.03
    assert abs(gaps.std() / gaps.mean() - cv) / cv < 0.05


def test_constant_and_burst_are_exact():
    assert np.allclose(times(ArrivalProcess("constant", rate=4.0), count=5), [0, 0.25, 0.5, 0.75, 1.0])
    burst = ArrivalProcess("burst", size=3, every_s=2.0)
    assert np.allclose(times(burst, count=7), [0, 0, 0, 2, 2, 2, 4])
    assert np.allclose(times(burst, duration_s=5.0), [0, 0, 0, 2, 2, 2, 4, 4, 4])
    assert burst.mean_rate == 1.5


@pytest.mark.parametrize(
    "process",
    [ArrivalProcess("poisson", rate=20.0), ArrivalProcess("gamma", rate=20.0, cv=3.0), ArrivalProcess("constant", rate=20.0)],
)
def test_duration_gives_every_arrival_before_it(process):
    t = times(process, duration_s=500.0)
    assert t[0] == 0 and t[-1] < 500.0 and np.all(np.diff(t) >= 0)
    assert abs(len(t) - 10_000) < 600  # 20/s for 500 s; gamma cv 3 varies most (sd ~ 3 * 100)
