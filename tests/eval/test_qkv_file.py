"""Q/K/V of one's own from a file (``load_qkv_file``): what it reads, and the sentence
for everything it does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyformer.eval.data.qkv import load_qkv_file


def _qkv(b: int = 2, h: int = 3, n: int = 8, d: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, n, d, generator=g) for _ in range(3))


def _mask(b: int = 2, n: int = 8) -> torch.Tensor:
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, n - 3:] = False
    return mask


@pytest.mark.parametrize("key", ["mask", "key_padding_mask"])
def test_a_dict_with_a_key_padding_mask_gives_it_back(tmp_path, key):
    q, k, v = _qkv()
    torch.save({"q": q, "k": k, "v": v, key: _mask()}, tmp_path / "qkv.pt")
    saved = load_qkv_file(tmp_path / "qkv.pt")
    assert torch.equal(saved.q, q) and torch.equal(saved.v, v)
    assert torch.equal(saved.key_padding_mask, _mask())


def test_three_tensors_in_order_have_no_mask(tmp_path):
    q, k, v = _qkv()
    torch.save([q, k, v], tmp_path / "qkv.pt")
    saved = load_qkv_file(tmp_path / "qkv.pt")
    assert torch.equal(saved.k, k) and saved.key_padding_mask is None


@pytest.mark.parametrize("name", ["qkv.npz", "qkv.pt"])
def test_numpy_npz_files_are_read_by_their_content(tmp_path, name):
    """NumPy is a dependency: an .npz (whatever its suffix) is read, not handed to
    torch.load, which answered with a paragraph on its unpickler."""
    q, k, v = _qkv()
    with open(tmp_path / name, "wb") as handle:  # np.savez would add .npz to a name
        np.savez(handle, q=q.numpy(), k=k.numpy(), v=v.numpy(), mask=_mask().numpy())
    saved = load_qkv_file(tmp_path / name)
    assert torch.equal(saved.q, q) and saved.q.dtype == torch.float32
    assert torch.equal(saved.key_padding_mask, _mask())


def test_a_numpy_npy_file_of_one_array_is_refused_in_a_sentence(tmp_path):
    np.save(tmp_path / "q.npy", _qkv()[0].numpy())
    with pytest.raises(ValueError, match=r"^the file '.*q\.npy' is a NumPy \.npy file, which "
                                         r"holds one array; save the queries, keys and values "
                                         r"together with np\.savez\(path, q=q, k=k, v=v\)\.$"):
        load_qkv_file(tmp_path / "q.npy")


def test_an_npz_of_objects_is_refused_without_unpickling(tmp_path):
    q, k, v = (np.array([None, 1], dtype=object) for _ in range(3))
    np.savez(tmp_path / "qkv.npz", q=q, k=k, v=v)
    with pytest.raises(ValueError, match=r"is a NumPy \.npz file whose arrays cannot be read "
                                         r"as tensors .*np\.savez"):
        load_qkv_file(tmp_path / "qkv.npz")


def test_other_files_get_one_line_not_torchs_paragraph(tmp_path):
    (tmp_path / "qkv.txt").write_bytes(b"\x80\x02 not a pickle")
    with pytest.raises(ValueError, match=r"is not a file of torch\.save holding tensors") as err:
        load_qkv_file(tmp_path / "qkv.txt", label="--qkv")
    message = str(err.value)
    assert message.startswith("--qkv '") and "\n" not in message
    assert "PyTorch 2.6" not in message and "Weights only load failed" not in message


def test_keys_it_does_not_read_are_refused_naming_those_it_reads(tmp_path):
    """A mask under another name was silently left out of the measurement."""
    q, k, v = _qkv()
    torch.save({"q": q, "k": k, "v": v, "attention_mask": _mask()}, tmp_path / "qkv.pt")
    with pytest.raises(ValueError, match=r"holds \['attention_mask'\] besides q, k and v, "
                                         r"which are not read: the keys read are q, k, v and, "
                                         r"optionally, mask or key_padding_mask"):
        load_qkv_file(tmp_path / "qkv.pt")
    torch.save({"q": q, "k": k, "v": v, "mask": _mask(), "key_padding_mask": _mask()},
               tmp_path / "qkv.pt")
    with pytest.raises(ValueError, match="holds both mask and key_padding_mask; keep one"):
        load_qkv_file(tmp_path / "qkv.pt")


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 8, dtype=torch.long), r"mask must be a bool tensor \(True = real token\), "
                                         r"got torch\.int64; .* converts with mask == 1"),
    (torch.ones(2, 7, dtype=torch.bool), r"mask must have shape \[B, Nk\] = \[2, 8\], got "
                                         r"\(2, 7\)"),
    ([[True] * 8] * 2, r"mask must be a torch\.Tensor"),
])
def test_a_malformed_mask_is_refused_in_a_sentence(tmp_path, mask, message):
    q, k, v = _qkv()
    torch.save({"q": q, "k": k, "v": v, "mask": mask}, tmp_path / "qkv.pt")
    with pytest.raises((TypeError, ValueError), match=r"^--qkv '.*qkv\.pt': " + message):
        load_qkv_file(tmp_path / "qkv.pt", label="--qkv")


@pytest.mark.parametrize("index, fix", [
    (0, r"for the heads of one sequence, \[H, N, D\], add the batch dimension with "
        r"q\.unsqueeze\(0\)"),
    ((0, 0), r"for one head of one sequence, \[N, D\], add the batch and head dimensions "
             r"with q\[None, None\]"),
])
def test_tensors_short_of_dimensions_get_the_call_that_adds_them(tmp_path, index, fix):
    """'split heads first' was the wrong advice for [H, N, D] or [N, D] tensors."""
    q, k, v = _qkv()
    torch.save({"q": q[index], "k": k[index], "v": v[index]}, tmp_path / "qkv.pt")
    with pytest.raises(ValueError, match=r"q has shape \(.*\), [23] dimensions, not "
                                         r"\[B, H, N, D\]: " + fix):
        load_qkv_file(tmp_path / "qkv.pt")


def test_a_dict_whose_q_is_no_tensor_says_so(tmp_path):
    q, k, v = _qkv()
    torch.save({"q": q.tolist(), "k": k, "v": v}, tmp_path / "qkv.pt")
    with pytest.raises(ValueError, match=r"q is a list, not a tensor \[B, H, N, D\]"):
        load_qkv_file(tmp_path / "qkv.pt")
