import pytest

from domino_ray.spec_decode.stats import RowStats, merge_histograms, per_position_acceptance, total_stats


def test_row_stats_conventions():
    s = RowStats(num_spec_tokens=4)
    for drafted, accepted in [(4, 4), (4, 0), (4, 2), (1, 1)]:
        s.observe_step(drafted, accepted)
    assert s.acceptance_histogram == [1, 1, 1, 0, 1]
    assert s.num_spec_steps == 4 and s.num_accepted_draft_tokens == 7 and s.num_draft_tokens == 13
    assert s.mean_acceptance_length == pytest.approx(1 + 7 / 4)   # includes the bonus token
    assert s.draft_acceptance_rate == pytest.approx(7 / 13)
    cols = s.to_columns()
    assert sum(cols["acceptance_histogram"]) == cols["num_spec_steps"]
    assert sum(j * n for j, n in enumerate(cols["acceptance_histogram"])) == cols["num_accepted_draft_tokens"]


def test_no_steps():
    s = RowStats(num_spec_tokens=0)
    assert s.mean_acceptance_length == 0.0 and s.draft_acceptance_rate == 0.0 and s.acceptance_histogram == [0]


def test_accepting_more_than_drafted_is_a_bug():
    with pytest.raises(AssertionError):
        RowStats(num_spec_tokens=4).observe_step(2, 3)


def test_per_position_acceptance_and_merge():
    h = merge_histograms([[1, 0, 2], [1, 1, 0]])
    assert h == [2, 1, 2]
    assert per_position_acceptance(h) == pytest.approx([3 / 5, 2 / 5])
    assert per_position_acceptance([0, 0, 0]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        merge_histograms([[1, 2], [1, 2, 3]])


def test_total_stats_pools_steps_not_ratios():
    a, b = RowStats(2), RowStats(2)
    a.observe_step(2, 2)                       # one step, 3 tokens
    for _ in range(3):
        b.observe_step(2, 0)                   # three steps, 1 token each
    total = total_stats([a, b])
    assert (total.num_spec_steps, total.num_accepted_draft_tokens, total.num_draft_tokens) == (4, 2, 8)
    assert total.acceptance_histogram == [3, 0, 1]
    assert total.mean_acceptance_length == 1.5  # 6 tokens / 4 steps, not the mean of 3.0 and 1.0
    assert total_stats([]).mean_acceptance_length == 0.0
