"""Snapshot-interval advice: Young's and Daly's formulas, the loss model, the article's rules, the
command-line pieces, and clear errors for inputs that make no sense."""

import argparse
import json
import math

import pytest

from async_ckpt.tools.advise import (add_arguments, advise, advise_from_args, expected_loss,
                               format_advice, render)
from async_ckpt.tools.argtypes import parse_duration

HOUR, DAY = 3600.0, 86400.0


def test_young_and_daly_known_values():
    r = advise(step_time_s=0.5, snapshot_cost_s=1.0, mtbf_s=5000.0)
    assert r["young_interval_s"] == pytest.approx(100.0)  # sqrt(2 * 1 * 5000)
    # Daly: sqrt(2bM) (1 + sqrt(b/2M)/3 + (b/2M)/9) - b with b/2M = 1e-4
    assert r["daly_interval_s"] == pytest.approx(100 * (1 + 0.01 / 3 + 1e-4 / 9) - 1)
    assert r["interval_steps"] == round(r["daly_interval_s"] / 0.5) == 199
    assert r["interval_s"] == pytest.approx(99.5)
    assert r["limited_by"] is None


def test_first_order_loss_at_the_optimum_is_about_sqrt_2b_over_m():
    b, m = 2.0, DAY
    r = advise(step_time_s=0.01, snapshot_cost_s=b, mtbf_s=m)
    assert r["fraction_lost"] == pytest.approx(math.sqrt(2 * b / m), rel=0.01)
    assert r["fraction_checkpointing"] == pytest.approx(b / (r["interval_s"] + b))
    assert r["fraction_rework"] == pytest.approx((r["interval_s"] + b) / 2 / m)
    assert r["fraction_lost_exponential"] == pytest.approx(r["fraction_lost"], rel=0.01)


@pytest.mark.parametrize("cost, blocking", [(3.0, None), (30.0, 0.5), (600.0, None)])
def test_the_recommended_interval_beats_its_neighbours(cost, blocking):
    r = advise(step_time_s=0.1, snapshot_cost_s=cost, mtbf_s=6 * HOUR, blocking_s=blocking)
    best = r["fraction_lost_exponential"]
    assert best == expected_loss(0.1, cost, 6 * HOUR, r["interval_steps"],
                                 blocking)["fraction_lost_exponential"]
    for factor in (0.5, 0.8, 1.25, 2.0):
        steps = round(r["interval_steps"] * factor)
        other = expected_loss(0.1, cost, 6 * HOUR, steps, blocking)["fraction_lost_exponential"]
        assert best <= other + 1e-12, factor


def test_expected_loss_rejects_a_bad_interval():
    with pytest.raises(ValueError, match="interval_steps"):
        expected_loss(0.1, 1.0, DAY, 0)


def test_monotonic_in_cost_and_mtbf():
    intervals = [advise(0.1, c, DAY)["daly_interval_s"] for c in (0.1, 1.0, 10.0, 100.0)]
    assert intervals == sorted(intervals)
    losses = [advise(0.1, c, DAY)["fraction_lost"] for c in (0.1, 1.0, 10.0, 100.0)]
    assert losses == sorted(losses)
    by_mtbf = [advise(0.1, 1.0, m) for m in (HOUR, DAY, 30 * DAY)]
    assert [r["daly_interval_s"] for r in by_mtbf] == sorted(r["daly_interval_s"] for r in by_mtbf)
    assert [r["fraction_lost"] for r in by_mtbf] == sorted((r["fraction_lost"] for r in by_mtbf),
                                                           reverse=True)


def test_async_interval_uses_blocking_time_and_lag_adds_rework():
    blocking = advise(0.1, 10.0, DAY)
    async_ = advise(0.1, 10.0, DAY, blocking_s=0.1)
    assert async_["durability_lag_s"] == pytest.approx(9.9)
    assert async_["young_interval_s"] == pytest.approx(math.sqrt(2 * 0.1 * DAY))
    assert async_["interval_s"] < blocking["interval_s"]
    assert async_["fraction_lost"] < blocking["fraction_lost"]
    # the lag is charged once per failure
    no_lag = advise(0.1, 0.1, DAY)
    assert async_["interval_steps"] == no_lag["interval_steps"]
    assert async_["fraction_rework"] - no_lag["fraction_rework"] == pytest.approx(9.9 / DAY)


def test_interval_is_at_least_the_durability_lag():
    r = advise(step_time_s=0.03, snapshot_cost_s=5.0, mtbf_s=60.0, blocking_s=0.01)
    assert r["daly_interval_s"] < 4.99
    assert r["interval_s"] >= 4.99
    assert r["limited_by"] == "time to durable"


def test_zero_cost_snapshots_every_step():
    r = advise(step_time_s=0.03, snapshot_cost_s=0.0, mtbf_s=HOUR)
    assert r["young_interval_s"] == r["daly_interval_s"] == 0.0
    assert r["interval_steps"] == 1 and r["limited_by"] == "one step"
    assert r["fraction_checkpointing"] == 0.0
    assert r["fraction_rework"] == pytest.approx(0.015 / HOUR)
    assert "every step" in format_advice(r)


def test_rule_of_thumb_is_one_to_five_percent_of_the_run():
    r = advise(step_time_s=1.0, snapshot_cost_s=60.0, mtbf_s=DAY, total_steps=10 * 86400)
    rule = r["rule_of_thumb"]
    assert rule["interval_s"] == pytest.approx([0.01 * 10 * DAY, 0.05 * 10 * DAY])
    assert rule["interval_steps"] == [8640, 43200]
    assert rule["fraction_lost"][1] > rule["fraction_lost"][0] > r["fraction_lost"]
    assert r["cluster_rule"]["interval_steps"] == [1000, 2000]
    assert r["totals"]["snapshots"] == 10 * 86400 // r["interval_steps"]
    assert r["totals"]["lost_s"] > 0
    assert advise(1.0, 60.0, DAY)["rule_of_thumb"] is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(step_time_s=1.0, snapshot_cost_s=100.0, mtbf_s=50.0), "longer than the snapshot cost"),
    (dict(step_time_s=1.0, snapshot_cost_s=60.0, mtbf_s=60.0), "longer than the snapshot cost"),
    (dict(step_time_s=0.0, snapshot_cost_s=1.0, mtbf_s=DAY), "step_time_s must be positive"),
    (dict(step_time_s=-1.0, snapshot_cost_s=1.0, mtbf_s=DAY), "must not be negative"),
    (dict(step_time_s=1.0, snapshot_cost_s=-1.0, mtbf_s=DAY), "must not be negative"),
    (dict(step_time_s=1.0, snapshot_cost_s=math.nan, mtbf_s=DAY), "finite"),
    (dict(step_time_s=1.0, snapshot_cost_s=1.0, mtbf_s=math.inf), "finite"),
    (dict(step_time_s=1.0, snapshot_cost_s=1.0, mtbf_s=DAY, blocking_s=2.0), "cannot exceed"),
    (dict(step_time_s=1.0, snapshot_cost_s=1.0, mtbf_s=DAY, total_steps=0), "total_steps"),
    (dict(step_time_s=1.0, snapshot_cost_s=1.0, mtbf_s=DAY, total_steps=2.5), "total_steps"),
    (dict(step_time_s="1", snapshot_cost_s=1.0, mtbf_s=DAY), "finite number"),
])
def test_bad_inputs_raise_clear_value_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        advise(**kwargs)


def test_format_advice_mentions_every_part():
    text = format_advice(advise(0.35, 2.4, DAY, blocking_s=0.12, total_steps=2_500_000))
    for words in ("blocks training 120 ms", "durable after 2.4 s", "Young", "Daly",
                  "recommended: every", "to snapshots", "to rework", "1-5% of the",
                  "1000-2000 steps", "expected failures"):
        assert words in text, words
    assert "give the total steps" in format_advice(advise(0.35, 2.4, DAY))


@pytest.mark.parametrize("text, seconds", [("0.35", 0.35), ("350ms", 0.35), ("2.5s", 2.5),
                                           ("10min", 600), ("10m", 600), ("24h", 86400),
                                           ("7d", 604800), (" 1e3 ", 1000), ("2H", 7200)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10 years", "-1s", "1.2.3"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_command_line_pieces(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--step-time", "350ms", "--mtbf", "24h", "--snapshot-cost", "2.4s",
                              "--blocking", "120ms", "--total-steps", "1000000"])
    result = advise_from_args(args)
    assert result["blocking_s"] == pytest.approx(0.12)
    assert "recommended" in render(args, result)
    args.json = True
    assert json.loads(render(args, result))["interval_steps"] == result["interval_steps"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--step-time", "fast", "--mtbf", "1h", "--snapshot-cost", "1s"])
    assert "not a duration" in capsys.readouterr().err
    args = parser.parse_args(["--step-time", "1s", "--mtbf", "1s", "--snapshot-cost", "2s"])
    with pytest.raises(ValueError, match="longer than the snapshot cost"):
        advise_from_args(args)
