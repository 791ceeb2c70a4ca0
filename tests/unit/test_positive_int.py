"""The one parser of positive integers written as text, and the argparse type built on it."""

from __future__ import annotations

import argparse

import pytest

from shardserve.cli import common
from shardserve.process import settings
from shardserve.process.integers import MAX_DIGITS, parse_positive_int


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", 1), ("42", 42), ("007", 7), ("9" * MAX_DIGITS, 10**MAX_DIGITS - 1)],
)
def test_ascii_digits_are_read(text: str, value: int) -> None:
    assert parse_positive_int(text) == value
    assert parse_positive_int(text, zero_allowed=True) == value


@pytest.mark.parametrize(
    "text",
    [
        "¹",  # superscript one: str.isdigit() says yes, int() refuses it
        "٣",  # Arabic-Indic three: int() reads 3
        "１",  # fullwidth one: int() reads 1
        "߁",  # NKo one
        "+1",
        "-1",
        " 1",
        "1 ",
        "1\n",
        "1_000",
        "1.0",
        "1e3",
        "0x10",
        "",
        "9" * (MAX_DIGITS + 1),
        "9" * 5000,  # beyond int()'s own limit on digits: must not raise
    ],
)
def test_anything_else_is_none(text: str) -> None:
    assert parse_positive_int(text) is None
    assert parse_positive_int(text, zero_allowed=True) is None


def test_zero_only_where_allowed() -> None:
    assert parse_positive_int("0") is None
    assert parse_positive_int("000") is None
    assert parse_positive_int("0", zero_allowed=True) == 0


def test_every_value_fits_a_signed_64_bit_integer() -> None:
    largest = parse_positive_int("9" * MAX_DIGITS)
    assert largest is not None and largest < 2**63


def test_one_argparse_type_for_services_and_subcommands() -> None:
    assert common.positive_int is settings.positive_int
    assert settings.positive_int("12") == 12


@pytest.mark.parametrize("text", ["0", "-3", "٣", "¹", " 2", "x"])
def test_argparse_type_refuses_with_the_rule(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="ASCII digits") as caught:
        settings.positive_int(text)
    assert repr(text) in str(caught.value)


def test_a_parser_reports_the_bad_count() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--layers", type=settings.positive_int)
    assert parser.parse_args(["--layers", "3"]).layers == 3
    with pytest.raises(argparse.ArgumentError, match="'٣'"):
        parser.parse_args(["--layers", "٣"])
