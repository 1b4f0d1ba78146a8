"""The shared checks of user-given integers (``skyformer.checks``) and the sentences
they give where the library calls them."""

import numpy as np
import pytest
import torch

import skyformer
from skyformer.checks import check_positive_int, check_positive_ints


@pytest.mark.parametrize("value", [0, -3, True, False, 2.0, "4", None])
def test_a_positive_integer_refuses_what_is_not_one(value):
    with pytest.raises(ValueError, match=rf"^size must be a positive integer, got {value!r}\.$"):
        check_positive_int("size", value)


def test_optional_takes_none_and_says_so_when_it_refuses():
    check_positive_int("size", None, optional=True)
    check_positive_int("size", 3, optional=True)
    with pytest.raises(ValueError, match=r"^size must be a positive integer or None, got 0\.$"):
        check_positive_int("size", 0, optional=True)


@pytest.mark.parametrize("value", [np.int64(8), torch.tensor(8)])
def test_numpy_and_torch_integers_get_a_hint(value):
    with pytest.raises(ValueError, match=r"\(a Python int: pass int\(value\)\)"):
        check_positive_int("size", value)


@pytest.mark.parametrize("value", [np.float32(3.5), torch.tensor(3.5), torch.tensor(True)])
def test_a_float_or_bool_scalar_gets_no_int_hint(value):
    """int(value) would not fix a 3.5, and would turn True into 1."""
    with pytest.raises(ValueError) as err:
        check_positive_int("size", value)
    assert "pass int(value)" not in str(err.value)


def test_a_list_names_its_bad_entries_and_refuses_an_empty_one():
    check_positive_ints("lengths", [1, 2, 3])
    with pytest.raises(ValueError, match=r"^lengths must be positive integers, got \[0, True\]\.$"):
        check_positive_ints("lengths", [4, 0, True])
    with pytest.raises(ValueError, match=r"^lengths must be positive integers, got none\.$"):
        check_positive_ints("lengths", [])
    with pytest.raises(ValueError, match=r"pass int\(value\)"):
        check_positive_ints("lengths", [np.int32(4)])
    with pytest.raises(ValueError, match=r"pass int\(value\)\), got \[np.int64"):  # an array
        check_positive_ints("lengths", np.array([3, 0]))


def test_the_layer_and_the_methods_use_them():
    with pytest.raises(ValueError, match=r"^MultiHeadAttention: dim must be a positive integer "
                                         r"\(a Python int: pass int\(value\)\), got"):
        skyformer.MultiHeadAttention(dim=np.int64(64), num_heads=4)
    with pytest.raises(ValueError, match=r"^skyformer: num_features must be a positive integer, "
                                         r"got True\.$"):
        skyformer.get_method("skyformer").bind(num_features=True)


def test_bench_refuses_a_bool_in_a_shape():
    from skyformer.eval.bench.run import BenchConfig

    with pytest.raises(ValueError, match=r"a shape is \(B, H, D\) with positive integers"):
        BenchConfig(seq_lens=(64,), shapes=((1, True, 8),))


@pytest.mark.parametrize("text", ["2,2", "2,x,64", "2,0,64", "2,2,64,1", ""])
def test_a_shape_argument_refuses_other_counts_and_non_positive_fields(text):
    import argparse

    from skyformer.checks import shape_argument

    with pytest.raises(argparse.ArgumentTypeError,
                       match=rf"^must be B,H,D, positive integers, got {text!r}$"):
        shape_argument("B,H,D")(text)
    assert shape_argument("B,H,D")("2,3,64") == (2, 3, 64)


@pytest.mark.parametrize("text", ["4,16,64", "4,16,bfloat16", "4,16,64,bf16", "4,0,64,float32",
                                  "4,16,64,int64", "float32"])
def test_a_shape_dtype_argument_refuses_a_bad_shape_or_dtype(text):
    import argparse

    from skyformer.checks import shape_dtype_argument

    with pytest.raises(argparse.ArgumentTypeError,
                       match=rf"^must be B,H,D,dtype \(positive integers, dtype one of "
                             rf"float32, bfloat16, float16, float64\), got {text!r}$"):
        shape_dtype_argument("B,H,D")(text)
    assert shape_dtype_argument("B,H,D")("4,16,64,bfloat16") == "4,16,64,bfloat16"


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "fast"])
def test_a_positive_float_argument_refuses_what_no_rate_is(text):
    import argparse

    from skyformer.checks import positive_float_argument

    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be a positive number, got "):
        positive_float_argument(text)
    assert positive_float_argument("3e-3") == 0.003
