"""A seeded request's draws (sample/seeded_draws.py): a pure function of its seed and position,
uniform on [0, 1) along a request's positions and across seeds, every 64-bit seed taken."""

from __future__ import annotations

import numpy as np

from vllm_lite.sample.seeded_draws import position_uniforms, seed_key

N = 200_000


def _looks_uniform(u: np.ndarray) -> None:
    assert u.dtype == np.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    ks = float(np.abs(np.sort(u) - (np.arange(len(u)) + 0.5) / len(u)).max())
    assert ks < 1.63 / np.sqrt(len(u)) + 1e-6, f"Kolmogorov-Smirnov distance {ks:.5f}"  # (1% level)
    counts = np.bincount((u * 64).astype(np.int64), minlength=64)
    chi2 = float(((counts - len(u) / 64) ** 2 / (len(u) / 64)).sum())
    assert chi2 < 63 + 6 * np.sqrt(2 * 63), f"chi-square {chi2:.1f} with 63 dof"
    lag1 = float(np.corrcoef(u[:-1], u[1:])[0, 1])
    assert abs(lag1) < 5 / np.sqrt(len(u)), f"lag-1 correlation {lag1:.5f}"


def test_one_request_along_its_positions() -> None:
    keys = np.full(N, seed_key(1234), dtype=np.uint64)
    _looks_uniform(position_uniforms(keys, np.arange(N)))


def test_many_requests_at_one_position() -> None:
    keys = np.array([seed_key(seed) for seed in range(N)], dtype=np.uint64)
    _looks_uniform(position_uniforms(keys, np.full(N, 17)))
    # neighbouring seeds (n > 1 gives seed + index) at neighbouring positions are not each other's shift
    assert not np.array_equal(position_uniforms(keys[1:1001], np.arange(1000)),
                              position_uniforms(keys[:1000], np.arange(1, 1001)))


def test_a_draw_is_its_seed_and_position_alone() -> None:
    positions = np.array([0, 5, 5, 70_000], dtype=np.int64)
    for seed in (0, 1, -1, -(2 ** 63), 2 ** 64 - 1, 123_456_789):
        keys = np.full(len(positions), seed_key(seed), dtype=np.uint64)
        first = position_uniforms(keys, positions)
        assert first[1] == first[2] and len({float(x) for x in first}) == 3
        assert np.array_equal(position_uniforms(keys[::-1], positions[::-1]), first[::-1])
    assert seed_key(-1) == seed_key(2 ** 64 - 1)  # (the same 64 bits)
    assert len({int(seed_key(seed)) for seed in (0, 1, 2, -1, -2, 2 ** 63)}) == 6
