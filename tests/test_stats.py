import pytest

from domino_ray.stats import RowStats, merge_histograms, per_position_acceptance


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
