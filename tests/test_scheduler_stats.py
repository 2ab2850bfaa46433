"""The stats line's prediction part (SchedulerStats.prediction_summary): a run that made no prediction because
every expert it would have named was cached says so, instead of "prediction exact 0%"."""

from fate_edge.runtime.scheduler_stats import SchedulerStats


def test_predictions_made_are_reported_as_their_exact_share():
    assert SchedulerStats(predictions=4, exact=3).prediction_summary == "prediction exact 75%"


def test_predictions_skipped_for_a_cached_model_are_not_reported_as_misses():
    summary = SchedulerStats(predictions_skipped=12).prediction_summary
    assert summary.startswith("no prediction needed") and "%" not in summary


def test_no_prediction_at_all_says_none_was_made():
    assert SchedulerStats().prediction_summary == "no prediction made"
