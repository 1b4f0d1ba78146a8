"""State the library writes during calls, used from several threads at once (a model
server). Each test widens the window a race needs (a pause where a thread could be
switched out), so that without the guard it fails every time rather than now and then.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from skyformer import MultiHeadAttention
from skyformer import nn as sky_nn
from skyformer.registry import Capabilities, register
from skyformer.registry import methods as registry_methods
from skyformer.registry.outputs import registered_name


def _in_threads(work, count: int = 2) -> list:
    """``work(i)`` in ``count`` threads started together; their results, or the error."""
    results: list = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except Exception as err:  # the test reads it
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@dataclasses.dataclass(frozen=True)
class _NoOptions:
    pass


def test_a_method_registered_while_the_registry_is_read_ends_no_call(monkeypatch):
    """A plugin's call reads the registry for its name (``registered_name``); another
    thread registering a method meanwhile ended that read with 'dictionary changed size
    during iteration' (one plugin call in ten under a stream of registrations)."""
    for name in ("reads_registry", "registered_meanwhile"):
        monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)

    @register("reads_registry", _NoOptions, Capabilities(target="softmax"))
    def reads_registry(q, k, v, config, *, key_padding_mask=None, generator=None):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    class RegistersWhenRead:
        """A registry entry whose core, when read, registers another method: what a
        thread switch at that moment does."""

        name = "registers_when_read"

        @property
        def core(self):
            if "registered_meanwhile" not in registry_methods._REGISTRY:
                register("registered_meanwhile", _NoOptions,
                         Capabilities(target="softmax"))(reads_registry.__wrapped__)
            return None

    monkeypatch.setitem(registry_methods._REGISTRY, "registers_when_read",
                        RegistersWhenRead())
    spec = registry_methods._REGISTRY["reads_registry"]
    assert registered_name(spec.core) == "reads_registry"
    assert "registered_meanwhile" in registry_methods._REGISTRY


def test_caches_made_at_once_on_one_layer_all_step_it(monkeypatch):
    """The first caches of a layer shared by threads (a server starting several decodes
    at once): each thread saw no token yet and stored its own, so the caches of all but
    the last were refused as another layer's."""
    made = sky_nn._LayerToken

    class SlowToken(made):
        __slots__ = ()

        def __init__(self, parent=None):
            time.sleep(0.05)  # both threads have looked for a token by now
            super().__init__(parent)

    monkeypatch.setattr(sky_nn, "_LayerToken", SlowToken)
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="softmax", causal=True).eval()
    x = torch.randn(1, 3, 16)

    both_made = threading.Barrier(2)

    def decode(_: int) -> torch.Tensor:
        cache = layer.new_cache()
        both_made.wait()  # the layer holds its last token by now
        with torch.no_grad():
            return layer(x, cache=cache)

    outs = _in_threads(decode)
    assert not [o for o in outs if isinstance(o, Exception)], outs
    torch.testing.assert_close(outs[0], outs[1])


def test_two_saves_of_one_model_at_once_leave_its_config_as_it_was(tmp_path, monkeypatch):
    """Each save puts the model's record in its config, then what the config held: two
    saves at once, and the second put back the first one's record for good."""
    pytest.importorskip("transformers")
    import skyformer.hf as shf
    from skyformer.hf.record import RECORD_KEY
    from tests.hf.conftest import tiny_bert

    model = tiny_bert()
    shf.set_attention(model, "skyformer", num_features=8, seed=1)
    config_type = type(model.config)
    write_config = config_type.save_pretrained
    second_inside, first_done = threading.Event(), threading.Event()
    which = threading.local()

    def config_save(self, *args, **kwargs):  # inside the model's save, record in place
        if which.i == 0:  # holds until the second save is inside too (if it can get in)
            second_inside.wait(timeout=0.5)
        else:  # and the second ends after the first
            second_inside.set()
            first_done.wait(timeout=5)
        return write_config(self, *args, **kwargs)

    def save(i: int) -> None:
        which.i = i
        time.sleep(0.02 * i)  # the first is inside its save by now
        try:
            model.save_pretrained(tmp_path / f"copy{i}")
        finally:
            if i == 0:
                first_done.set()

    monkeypatch.setattr(config_type, "save_pretrained", config_save)
    outs = _in_threads(save)
    assert not [o for o in outs if isinstance(o, Exception)], outs
    assert RECORD_KEY not in model.config.__dict__
    for i in range(2):  # each copy records the setting
        assert RECORD_KEY in (tmp_path / f"copy{i}" / "config.json").read_text()
