"""The mixture of domains' prompt pools: shares by hand (smooth weighted round robin), global
indices, per-domain No-Positive-Resampling, and a restored pool drawing what the uninterrupted
one draws."""

from __future__ import annotations

import pytest

from scalerl_jax.data.mixture import MixturePool


def test_equal_weights_alternate_and_indices_are_global():
    pool = MixturePool({"math": 10, "code": 4}, {"math": 1.0, "code": 1.0}, seed=0, npr_threshold=None)
    drawn = pool.next_prompts(8)
    # ties go to the first domain: math, code, math, code, ...
    assert [pool.domain_of(p)[0] for p in drawn] == ["math", "code"] * 4
    assert all(0 <= p < 10 for p in drawn[0::2]) and all(10 <= p < 14 for p in drawn[1::2])
    # 4 code prompts in one epoch: the first four code draws are the four, each once
    assert sorted(p - 10 for p in drawn[1::2]) == [0, 1, 2, 3]


def test_weights_three_to_one():
    pool = MixturePool({"math": 50, "code": 50}, {"math": 3.0, "code": 1.0}, seed=1, npr_threshold=None)
    domains = [pool.domain_of(p)[0] for p in pool.next_prompts(400)]
    assert domains.count("math") == 300 and domains.count("code") == 100
    # every window of 4 draws holds exactly one code prompt (credits 0.75 / 0.25 per draw)
    assert all(domains[i : i + 4].count("code") == 1 for i in range(0, 400, 4))


def test_no_positive_resampling_is_per_domain():
    pool = MixturePool({"math": 3, "code": 2}, {"math": 1.0, "code": 1.0}, seed=0, npr_threshold=0.9)
    pool.record(3, 8, 8)  # code prompt 0 solved every time: retired
    pool.record(0, 1, 8)
    metrics = pool.metrics()
    assert metrics["data/code/pool_retired"] == 1 and metrics["data/math/pool_retired"] == 0
    assert metrics["data/pool_retired"] == 1 and metrics["data/pool_remaining"] == 4
    assert pool.pass_rate(3) == 1.0 and pool.pass_rate(0) == 0.125
    code_draws = [p for p in pool.next_prompts(20) if pool.domain_of(p)[0] == "code"]
    assert set(code_draws) == {4}  # only the code prompt still active


def test_a_restored_pool_draws_what_the_uninterrupted_one_draws():
    def make():
        return MixturePool({"math": 7, "code": 5}, {"math": 2.0, "code": 1.0}, seed=4, npr_threshold=0.9)

    uninterrupted, first = make(), make()
    expected = uninterrupted.next_prompts(9) + uninterrupted.next_prompts(20)
    head = first.next_prompts(9)
    restored = make()
    restored.load_state_dict(first.state_dict())
    assert head + restored.next_prompts(20) == expected


def test_bad_domains_and_weights_raise():
    with pytest.raises(ValueError, match="domains"):
        MixturePool({"math": 3}, {"code": 1.0}, seed=0, npr_threshold=None)
    with pytest.raises(ValueError, match="> 0"):
        MixturePool({"math": 3}, {"math": 0.0}, seed=0, npr_threshold=None)
    pool = MixturePool({"math": 3}, {"math": 1.0}, seed=0, npr_threshold=None)
    with pytest.raises(ValueError, match="domains"):
        pool.load_state_dict({"domains": {"code": {}}, "credit": {}})
