"""The option types every command shares: the same duration forms for `advise` and `supervise`,
whole numbers with bounds, and what counts as a number."""

import argparse

import pytest

from async_ckpt.tools import advise, supervisor
from async_ckpt.checks import is_number
from async_ckpt.tools.argtypes import DURATION_FORMS, duration_arg, int_arg, parse_duration
from async_ckpt.tools.cli import build_parser


def _duration_options(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] for a in parser._actions if a.metavar == "DURATION"]


ADVISE = argparse.ArgumentParser()
advise.add_arguments(ADVISE)
SUPERVISE = supervisor.build_parser()
ADVISE_REQUIRED = ["--step-time", "1s", "--mtbf", "1d", "--snapshot-cost", "2s"]


def test_every_duration_option_is_declared_as_one():
    assert _duration_options(ADVISE) == ["--step-time", "--mtbf", "--snapshot-cost", "--blocking",
                                         "--restart-time"]
    assert _duration_options(SUPERVISE) == ["--heartbeat-timeout", "--grace", "--startup-timeout",
                                            "--backoff"]


@pytest.mark.parametrize("option", _duration_options(ADVISE))
@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("5min", 300.0), ("0.5", 0.5),
                                           ("250ms", 0.25), ("2h", 7200.0)])
def test_advise_durations(option, text, seconds):
    args = ADVISE.parse_args(ADVISE_REQUIRED + [option, text])
    assert getattr(args, option[2:].replace("-", "_")) == pytest.approx(seconds)


@pytest.mark.parametrize("option", _duration_options(SUPERVISE))
@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("5min", 300.0), ("0.5", 0.5),
                                           ("250ms", 0.25), ("2h", 7200.0)])
def test_supervise_durations_take_the_same_forms(option, text, seconds):
    args = SUPERVISE.parse_args([option, text, "--", "true"])
    assert getattr(args, option[2:].replace("-", "_")) == pytest.approx(seconds)


@pytest.mark.parametrize("text, seconds", [("5.", 5.0), ("+5", 5.0), ("1_0", 10.0), ("1e3", 1000.0),
                                           ("1e-3s", 0.001)])
def test_every_number_float_reads_is_still_seconds(text, seconds):
    # what `supervise` accepted before it shared advise's units
    assert SUPERVISE.parse_args(["--grace", text, "--", "true"]).grace == pytest.approx(seconds)
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "-1", "-1s", "10 years", "1e999", "inf", "nan", "", "1e",
                                  "5 m s"])
def test_bad_durations_are_usage_errors(text, capsys):
    with pytest.raises(SystemExit) as exit:
        SUPERVISE.parse_args([f"--grace={text}", "--", "true"])
    assert exit.value.code == 2 and "not a duration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ADVISE.parse_args(ADVISE_REQUIRED + [f"--blocking={text}"])


def test_timeouts_must_be_positive_and_waits_may_be_zero():
    with pytest.raises(argparse.ArgumentTypeError, match="must be > 0"):
        duration_arg(positive=True)("0s")
    assert duration_arg()("0") == 0.0
    assert SUPERVISE.parse_args(["--grace", "0", "--backoff", "0ms", "--", "true"]).grace == 0.0
    with pytest.raises(SystemExit):
        SUPERVISE.parse_args(["--heartbeat-timeout", "0", "--", "true"])


def test_the_forms_are_documented_once_in_each_commands_help(capsys):
    for command in ("advise", "supervise"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        assert " ".join(DURATION_FORMS.split()) in " ".join(capsys.readouterr().out.split())


def test_parse_duration():
    assert parse_duration(" 1.5MIN ") == 90.0
    assert parse_duration("7d") == 7 * 86400
    with pytest.raises(ValueError, match="too long"):
        parse_duration("1e400s")


def test_int_arg():
    assert int_arg(0)("0") == 0 and int_arg(1, 255)("255") == 255
    for text, message in (("x", "not a whole number"), ("1.5", "not a whole number"),
                          ("0", "at least 1"), ("256", r"in 1\.\.255")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            int_arg(1, 255 if text == "256" else None)(text)


def test_is_number():
    assert is_number(1) and is_number(2.5) and is_number(float("nan"))
    assert not is_number(True) and not is_number("1") and not is_number(None)
