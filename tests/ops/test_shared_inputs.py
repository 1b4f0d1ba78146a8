"""Bad input gets a clear error naming the problem (for every method, through the dispatcher)."""

from __future__ import annotations

import pytest
import torch

from skyformer import attention, get_method, list_methods, random_key
from tests.conftest import lacks, make_qkv

METHODS = list_methods()


@pytest.mark.parametrize("method", METHODS)
def test_shape_errors(method):
    q, k, v = make_qkv(2, 2, 8, 4)
    with pytest.raises(ValueError, match=r"\[B, H, N, D\]"):
        attention(q[0], k, v, method)
    with pytest.raises(ValueError, match="same head dim"):
        attention(q, k[..., :3], v, method)
    with pytest.raises(ValueError, match="same sequence length"):
        attention(q, k, v[:, :, :5], method)
    with pytest.raises(ValueError, match=r"batch and head sizes.*shared by the 2 batch "
                       r"elements.*k\.expand\(2, -1, -1, -1\) and v\.expand\(2,"):
        attention(q, k[:1], v[:1], method)
    with pytest.raises(ValueError, match=r"same B and H\.$"):  # a batch of 2 against 1
        attention(q[:1], k, v, method)


@pytest.mark.parametrize("method", ["softmax", "skyformer"])
def test_fewer_key_value_heads_point_to_grouped_query_attention(method):
    """Every method runs grouped-query attention (``skyformer list``: enable_gqa yes), but
    a direct call with fewer key/value heads was told only that all must have the same
    H; it now names the call that groups them."""
    q, k, v = make_qkv(1, 4, 8, 4)
    with pytest.raises(ValueError, match=r"grouped-query attention.*"
                       r"scaled_dot_product_attention\(q, k, v, enable_gqa=True, "
                       f"method='{method}'"):
        attention(q, k[:, :2], v[:, :2], method)
    with pytest.raises(ValueError, match=r"same B and H\.$"):  # no grouping: as before
        attention(q, k[:, :3], v[:, :3], method)


@pytest.mark.parametrize("method", ["softmax", "skyformer"])
def test_sequence_first_tensors_are_named_where_their_shapes_give_them_away(method):
    """[B, N, H, D] tensors (FlashAttention's layout) were refused with "batch and head
    sizes differ" alone where the queries and keys differ in length, and a padding mask
    of the N tokens with "must have shape [B, Nk] = [B, H]"; both now add the layout and
    the transposes, as a possibility (a mask of the wrong length in cross-attention can
    look alike). Of one length and without a mask the layouts cannot be told apart."""
    b, n, h, d = 2, 10, 4, 8
    q, k, v = (torch.randn(b, n, h, d) for _ in range(3))
    transposes = (r"; if q, k and v are \[B, N, H, D\] \(sequence before heads.*pass "
                  r"q\.transpose\(1, 2\), k\.transpose\(1, 2\) and v\.transpose\(1, 2\)")
    with pytest.raises(ValueError, match=r"batch and head sizes differ.*" + transposes):
        attention(q[:, :1], k, v, method)  # a decoding step: one query
    with pytest.raises(ValueError, match=r"for grouped-query attention \(5 key/value heads.*"
                                         r"which repeats them" + transposes):  # both fit
        attention(q, k[:, :5], v[:, :5], method)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[B, Nk\] = "
                                         r"\[2, 4\], got \(2, 10\)" + transposes):
        attention(q, k, v, method, key_padding_mask=torch.ones(b, n, dtype=torch.bool))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("empty", ["B", "H", "N", "D", "Dv"])
def test_an_empty_dimension_is_named(method, empty):
    """Every method refuses an empty batch, head count, length or head dim alike."""
    q, k, v = make_qkv(2, 2, 8, 4)
    if empty in "BH":
        dim = "BH".index(empty)
        q, k, v = (t.narrow(dim, 0, 0) for t in (q, k, v))
    elif empty == "N":
        q, k, v = q[:, :, :0], k[:, :, :0], v[:, :, :0]
    else:
        q, k, v = (q[..., :0], k[..., :0], v) if empty == "D" else (q, k, v[..., :0])
    with pytest.raises(ValueError, match=r"empty input.*every dimension"):
        attention(q, k, v, method, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", METHODS)
def test_dtype_errors(method):
    q, k, v = make_qkv(1, 1, 6, 4)
    with pytest.raises(TypeError, match="floating point"):
        attention(q.long(), k.long(), v.long(), method)
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, k.float(), v, method)
    # floating point, but no method computes in it: a sentence, not torch's words from
    # inside the method ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn')
    eight = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*float32, float64, float16 or "
                                        r"bfloat16.*q.float\(\)"):
        attention(*eight, method, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("norm", [1.0, 100.0])
def test_mixed_dtypes_are_refused_whichever_tensor_differs(method, norm):
    """float32 queries with keys or values of another dtype, at unit norms and at norms
    past float32's reach (where a method may compute in float64): a sentence, never
    torch's words nor a silent conversion."""
    q, k, v = (t.float() * norm for t in make_qkv(1, 1, 6, 4))
    for other in (torch.float64, torch.float16, torch.int64):
        for mixed in ((q, k.to(other), v), (q, k, v.to(other)), (q, k.to(other), v.to(other))):
            with pytest.raises(TypeError, match=r"one dtype|floating point"):
                attention(*mixed, method, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", METHODS)
def test_mask_errors(method):
    q, k, v = make_qkv(2, 1, 6, 4)
    if lacks(method, "mask", lambda: attention(q, k, v, method,
                                               key_padding_mask=torch.ones(2, 6))):
        return  # any mask is refused, a wrong one too
    with pytest.raises(TypeError, match="bool"):
        attention(q, k, v, method, key_padding_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"\[B, Nk\]"):
        attention(q, k, v, method, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[B, Nk\]"):
        attention(q, k, v, method, key_padding_mask=torch.ones(2, 1, 1, 6, dtype=torch.bool))


@pytest.mark.parametrize("method", [m for m in METHODS
                                    if get_method(m).capabilities.has("attn_mask")])
def test_an_attn_mask_on_another_device_is_named(method):
    """An exact method's attn_mask on another device than the inputs (meta here, CUDA
    beside CPU inputs alike): a sentence, not torch's words or a bias read from no data."""
    q, k, v = make_qkv(1, 2, 6, 4)
    elsewhere = torch.ones(6, 6, dtype=torch.bool).tril().to("meta")
    with pytest.raises(ValueError, match=r"attn_mask is on meta but the inputs are on cpu; "
                                         r"pass attn_mask.to\('cpu'\)"):
        get_method(method).function(q, k, v, attn_mask=elsewhere)


def test_unknown_method_lists_available():
    q, k, v = make_qkv(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"unknown attention method 'flash'.*skyformer"):
        attention(q, k, v, "flash")


def test_a_generator_of_another_type_is_named_and_a_seed_gets_its_key():
    q, k, v = make_qkv(1, 1, 4, 4)
    with pytest.raises(TypeError, match=r"skyformer: generator must be a torch.Generator, a "
                       r"random key \(skyformer.random_key\(...\)\) or None, got int 3; for a "
                       r"seed pass generator=skyformer.random_key\(3\)\."):
        attention(q, k, v, "skyformer", generator=3)
    with pytest.raises(TypeError, match=r"or None, got float\.$"):
        attention(q, k, v, "skyformer", generator=3.0)
    attention(q, k, v, "skyformer", generator=random_key(3))  # the fix named


def test_unknown_option_lists_known_ones():
    q, k, v = make_qkv(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"no option 'landmarks'.*num_features"):
        attention(q, k, v, "skyformer", landmarks=4)
