"""SamplingParams' number checks: the int/float fast paths agree with the numbers-ABC reading on every kind of value."""

import enum
import math
import numbers

import numpy as np
import pytest

from rollout.sampling_params import SamplingParams, _is_int_like, _is_number


class Size(enum.IntEnum):
    SMALL = 4


class MyFloat(float):
    pass


VALUES = [0, 1, -3, 2**70, 16.0, 16.5, -0.0, math.nan, math.inf, -math.inf, True, False, np.int64(7), np.int32(-1),
          np.float32(2.0), np.float64(2.5), np.bool_(True), Size.SMALL, MyFloat(3.0), MyFloat(3.5), "4", None, [4]]


def naive_is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def naive_is_int_like(x) -> bool:
    return naive_is_number(x) and (isinstance(x, numbers.Integral) or (math.isfinite(x) and float(x).is_integer()))


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_number_checks_match_the_abc_reading(value):
    """_is_number / _is_int_like equal the naive numbers.Real / numbers.Integral reading for this value."""
    assert _is_number(value) == naive_is_number(value)
    assert _is_int_like(value) == naive_is_int_like(value)


@pytest.mark.parametrize("value,ok", [(8, True), (8.0, True), (8.5, False), (math.nan, False), (math.inf, False),
                                      (True, False), (np.int64(8), True), (Size.SMALL, True), ("8", False)], ids=repr)
def test_max_new_tokens_takes_int_like_values_only(value, ok):
    """max_new_tokens is read as an int exactly when it is int-like; otherwise a ValueError names the field."""
    if ok:
        assert SamplingParams.from_dict({"max_new_tokens": value}).max_new_tokens == int(value)
        assert type(SamplingParams.from_dict({"max_new_tokens": value}).max_new_tokens) is int
    else:
        with pytest.raises(ValueError, match="sampling param max_new_tokens must be an int"):
            SamplingParams.from_dict({"max_new_tokens": value})


def test_unknown_field_is_named():
    """A misspelt field is refused by name, with the known ones listed (the cached field names)."""
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['max_tokens'\]; known: .*'max_new_tokens'"):
        SamplingParams.from_dict({"max_tokens": 4})
