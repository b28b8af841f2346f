"""argtypes: each flag type parses a good value and refuses a bad one with ArgumentTypeError."""

from __future__ import annotations

import argparse

import pytest

from xllm.common.argtypes import (
    fraction,
    int_list,
    int_list_at_least,
    name_list,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)


def test_numbers():
    assert positive_int("3") == 3 and fraction("0.5") == 0.5 and fraction("1") == 1.0
    for parse, text in ((positive_int, "0"), (fraction, "0"), (fraction, "1.5")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_signed_bounds():
    assert non_negative_int("0") == 0 and positive_float("0.5") == 0.5 and non_negative_float("0") == 0.0
    for parse, text in ((non_negative_int, "-1"), (positive_float, "0"), (positive_float, "inf"),
                        (positive_float, "nan"), (non_negative_float, "-0.1"), (non_negative_float, "inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_int_list():
    assert int_list_at_least(0)("0,128") == [0, 128]
    with pytest.raises(argparse.ArgumentTypeError, match="integers >= 0"):
        int_list_at_least(0)("-1")
    assert int_list("16,64") == [16, 64] and int_list("4,") == [4]
    for text in ("", "0,4", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(text)


def test_name_list_keeps_the_given_or_the_choices_order():
    systems = name_list(("xllm", "vllm", "hf"), "system(s)")
    assert systems("hf,xllm") == ["hf", "xllm"]
    assert name_list(("xllm", "vllm", "hf"), "system(s)", in_order=True)("hf,xllm") == ["xllm", "hf"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown system\(s\) \['tgi'\]; choose from xllm, vllm, hf"):
        systems("xllm,tgi")
    with pytest.raises(argparse.ArgumentTypeError):
        systems("")
    assert name_list(("a",), "name(s)", allow_empty=True)("") == []
