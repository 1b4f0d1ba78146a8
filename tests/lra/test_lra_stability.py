"""The instability score of Skyformer Appendix F."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F

from skyformer.lra import load_cache, make_config
from skyformer.lra.batches import BatchOrder, Position, fetch
from skyformer.lra.model import LRAClassifier
from skyformer.lra.presets import learning_rate
from skyformer.lra.stability import (
    StabilityReport,
    format_table,
    instability_taus,
    run_stability,
)
from skyformer.lra.train import model_config


def _cfg(method="softmax", **kw):
    return make_config("listops", attention=method, batch_size=16, dropout=0.0, **kw)


@pytest.mark.parametrize("probe", ["normed", "hidden"])
def test_tau_is_output_change_over_parameter_change(listops_cache, probe):
    """Recompute tau_1 and tau_2 by hand for a deterministic method without dropout."""
    cfg = _cfg("kernelized")
    taus = instability_taus(cfg, listops_cache, steps=2, probe=probe)
    data = load_cache(listops_cache, "listops")
    torch.manual_seed(cfg.seed)
    model = LRAClassifier(model_config(cfg, data))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=1e-6, weight_decay=0.0)
    order, position = BatchOrder(len(data.splits["train"]), 16, cfg.seed), Position()
    for step in range(2):
        tokens, lengths, labels = fetch(data.splits["train"], order.batch(position), "cpu")
        w0 = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            f0 = copy.deepcopy(model).double().eval().embed(tokens, lengths,
                                                            normed=probe == "normed")
        F.cross_entropy(model(tokens, lengths), labels).backward()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            f1 = copy.deepcopy(model).double().eval().embed(tokens, lengths,
                                                            normed=probe == "normed")
        dw = sum(
            (p.double() - q.double()).square().sum()
            for p, q in zip(model.parameters(), w0, strict=True)
        )
        assert taus[step] == pytest.approx(((f1 - f0).square().sum() / dw).item(), rel=1e-6)
        position = order.next(position)
    assert all(t > 0 for t in taus)


def test_randomised_methods_use_the_same_draws_before_and_after(listops_cache):
    """With a zero learning rate nothing changes, so tau is undefined, and says so; with a
    tiny one tau stays finite for a randomised method (no sampling noise in the numerator)."""
    with pytest.raises(ValueError, match="did not change the parameters"):
        instability_taus(_cfg("skyformer", lr=1e-300), listops_cache, steps=1)
    taus = instability_taus(
        _cfg("skyformer", attention_options={"num_features": 4}), listops_cache, steps=3
    )
    assert all(0 < t < 1e6 for t in taus)


def test_table_three_layout_and_softmax_baseline(listops_cache):
    report = run_stability(
        ["listops"],
        ["softmax", "kernelized", "skyformer"],
        cache_root=listops_cache,
        seeds=[0, 1],
        steps=3,
        num_features=4,
        overrides={"batch_size": 16},
    )
    assert report.methods == ["kernelized", "skyformer"]
    assert len(report.taus["listops"]["softmax"][1]) == 3
    ratio = report.ratio("listops", "kernelized")
    by_hand = (
        sum(
            sum(
                a / b
                for a, b in zip(
                    report.taus["listops"]["kernelized"][s],
                    report.taus["listops"]["softmax"][s],
                    strict=True,
                )
            )
            / 3
            for s in (0, 1)
        )
        / 2
    )
    assert ratio == pytest.approx(by_hand)
    table = format_table(report)
    assert "| model | ListOps |" in table and f"| kernelized | {ratio:.2f} |" in table
    ratios = report.to_dict()["ratios"]["listops"]
    assert ratios["skyformer"] == report.ratio("listops", "skyformer")
    assert report.settings["listops"]["batch_size"] == 16
    with pytest.raises(ValueError, match="unknown attention method"):
        run_stability(["listops"], ["nope"], cache_root=listops_cache)
    with pytest.raises(ValueError, match="no method to compare with softmax"):
        run_stability(["listops"], ["softmax"], cache_root=listops_cache)
    with pytest.raises(ValueError, match="probe must be one of normed, hidden"):
        instability_taus(_cfg(), listops_cache, steps=1, probe="logits")


@pytest.mark.parametrize(("tasks", "features", "overrides", "message"), [
    (["listops"], 0, {}, "num_features must be a positive integer"),
    (["listops", "text"], None, {}, "lra prepare text"),
    (["listops"], None, {"max_len": 99}, "exceeds the prepared length 8"),
    (["listops"], None, {"batch_size": 10_000}, r"batch size \(10000\) exceeds the \d+ "),
])
def test_every_setting_is_checked_before_the_first_measurement(
        listops_cache, tasks, features, overrides, message, monkeypatch):
    """A bad option, an unprepared task, a length beyond the cache or a batch beyond a
    task's training split fails before softmax (or an earlier task) is measured, not
    after it (the taus measured then could not be resumed with the setting mended)."""
    from skyformer.lra import stability

    monkeypatch.setattr(stability, "instability_taus",
                        lambda *a, **k: pytest.fail("measured before the check"))
    said = []
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run_stability(tasks, ["skyformer"], cache_root=listops_cache, steps=1,
                      num_features=features, overrides={"batch_size": 16, **overrides},
                      progress=said.append)
    assert said == []


def test_a_task_listed_twice_is_refused(listops_cache):
    with pytest.raises(ValueError, match="tasks lists listops more than once; give each task once"):
        run_stability(["listops", "listops"], ["kernelized"], cache_root=listops_cache, steps=1)


def test_a_variant_setting_num_features_beside_features_is_refused(listops_cache):
    """--features sets num_features of every method: a variant's own value would be
    replaced while its row kept the variant's name."""
    said = []
    with pytest.raises(ValueError, match=r"skyformer\[num_features=8\]: lra stability "
                                         r"\(--features\) sets num_features on every call"):
        run_stability(["listops"], ["skyformer[num_features=8]"], cache_root=listops_cache,
                      steps=1, num_features=4, overrides={"batch_size": 16},
                      progress=said.append)
    assert said == []
    report = run_stability(["listops"], ["skyformer[num_features=8]"], cache_root=listops_cache,
                           steps=1, overrides={"batch_size": 16})
    assert report.attention_options["listops"]["skyformer[num_features=8]"]["num_features"] == 8


class _Interrupted(Exception):
    pass


def test_a_resumed_run_keeps_the_earlier_taus_and_equals_an_uninterrupted_one(listops_cache):
    """An interrupted stability run lost every tau measured (the file was written at the
    end only); a resumed run measures only what is missing, with the same result."""
    args = {"cache_root": listops_cache, "seeds": [0, 1], "steps": 2,
                "overrides": {"batch_size": 16}}
    whole = run_stability(["listops"], ["kernelized"], **args)
    saved = []

    def save_then_stop(report):
        saved.append(copy.deepcopy(report.to_dict()))
        if len(saved) == 3:
            raise _Interrupted

    with pytest.raises(_Interrupted):
        run_stability(["listops"], ["kernelized"], on_measured=save_then_stop, **args)
    partial = json.loads(json.dumps(saved[-1]))  # as the file holds it
    assert partial["complete"] is False and partial["ratios"] == {"listops": {}}
    said = []
    resumed = run_stability(["listops"], ["kernelized"], earlier=partial, progress=said.append,
                            **args)
    assert said == ["listops kernelized seed 1: mean tau "
                    f"{sum(whole.taus['listops']['kernelized'][1]) / 2:.4g}"]
    assert resumed.taus == whole.taus and resumed.to_dict()["complete"] is True
    assert resumed.ratio("listops", "kernelized") == whole.ratio("listops", "kernelized")


@pytest.mark.parametrize(("change", "differ"), [
    ({"steps": 3}, "steps: 2 -> 3"),
    ({"overrides": {"batch_size": 32}}, "the training settings of listops"),
    ({"num_features": 4}, "the options of skyformer on listops (num_features: "),
])
def test_resuming_with_other_settings_is_refused(listops_cache, change, differ):
    args = {"cache_root": listops_cache, "steps": 2, "overrides": {"batch_size": 16}}
    earlier = json.loads(json.dumps(
        run_stability(["listops"], ["skyformer"], **args).to_dict()))
    with pytest.raises(ValueError, match=rf"measured with other settings \(.*{re.escape(differ)}"):
        run_stability(["listops"], ["skyformer"], earlier=earlier, **{**args, **change})


def test_a_method_listed_twice_is_refused(listops_cache):
    """Listed twice, a method was merged into one row; two spellings of one variant
    were measured twice into identical rows."""
    for methods, named in ((["kernelized", "kernelized"], "kernelized"),
                           (["linear[eps=0.001]", "linear[eps=1e-3]"], r"linear\[eps=1e-3\]")):
        with pytest.raises(ValueError, match=rf"methods \(--methods\) lists .*{named}"):
            run_stability(["listops"], methods, cache_root=listops_cache, steps=1)


@pytest.mark.parametrize("method", ["performer", "linformer"])
def test_every_method_starts_from_the_initial_parameters_of_softmax(listops_cache, method,
                                                                    monkeypatch):
    """Performer drew its features, Linformer its projections, from torch's generator
    while the model was built, so every later layer of theirs started from other values
    than softmax's: the methods did not share W_0."""
    from skyformer.lra import stability

    first = []
    flat = stability._flat_parameters

    def spy(model):
        if not first:  # the first call: W_0, before the first update
            first.append({k: p.detach().clone() for k, p in model.named_parameters()})
        return flat(model)

    monkeypatch.setattr(stability, "_flat_parameters", spy)
    instability_taus(_cfg(method), listops_cache, steps=1)
    torch.manual_seed(0)
    softmax = LRAClassifier(model_config(_cfg(), load_cache(listops_cache, "listops")))
    for name, value in softmax.named_parameters():
        assert torch.equal(first[0][name], value), name


def test_features_redrawn_by_a_training_step_do_not_enter_tau(listops_cache):
    """Performer redraws its features in training calls; the probe after the step read the
    new features and the one before the old, so tau measured the redraw (a million times
    the parameter change's effect), not the update."""
    kept = instability_taus(_cfg("performer"), listops_cache, steps=3)
    redrawn = instability_taus(
        _cfg("performer", attention_options={"feature_redraw_interval": 1}), listops_cache,
        steps=3)
    assert redrawn[0] == pytest.approx(kept[0], rel=1e-9)  # the first call redraws nothing
    assert max(redrawn) < 10 * max(kept)


def test_resuming_with_other_seeds_keeps_the_taus_of_the_seeds_it_shares(listops_cache):
    """The settings kept per task held the seed of the first measurement, so resuming with
    --seeds 1 after --seeds 0 1 was refused for "the training settings of listops"."""
    args = {"cache_root": listops_cache, "steps": 2, "overrides": {"batch_size": 16}}
    earlier = json.loads(json.dumps(
        run_stability(["listops"], ["kernelized"], seeds=[0, 1], **args).to_dict()))
    assert "seed" not in earlier["settings"]["listops"]
    said = []
    resumed = run_stability(["listops"], ["kernelized"], seeds=[1], earlier=earlier,
                            progress=said.append, **args)
    assert said == []
    assert resumed.taus["listops"]["kernelized"][1] == earlier["taus"]["listops"]["kernelized"]["1"]
    earlier["settings"]["listops"]["seed"] = 0  # as files written before held it
    run_stability(["listops"], ["kernelized"], seeds=[1], earlier=earlier,
                  progress=said.append, **args)
    assert said == []


def test_a_refused_resume_names_the_training_settings_that_differ(listops_cache):
    args = {"cache_root": listops_cache, "steps": 1, "overrides": {"batch_size": 16}}
    earlier = json.loads(json.dumps(run_stability(["listops"], ["kernelized"], **args).to_dict()))
    with pytest.raises(ValueError, match=r"the training settings of listops \(batch_size: 16 -> "
                                         r"32, max_len: None -> 4\)"):
        run_stability(["listops"], ["kernelized"], earlier=earlier,
                      **{**args, "overrides": {"batch_size": 32, "max_len": 4}})


def test_resuming_on_other_prepared_data_is_refused(listops_cache, tmp_path):
    """The taus of a task prepared from other files were kept beside new ones: the file
    recorded nothing of the data it was measured on."""
    from skyformer.lra import prepare, write_listops
    from tests.lra.release_files import TINY_RULES

    write_listops(tmp_path / "src", train=256, dev=64, test=64, rules=TINY_RULES, seed=1)
    prepare("listops", tmp_path / "src", tmp_path / "cache", max_len=8)
    args = {"steps": 1, "overrides": {"batch_size": 16}}
    earlier = json.loads(json.dumps(
        run_stability(["listops"], ["kernelized"], cache_root=listops_cache, **args).to_dict()))
    assert earlier["data"]["listops"]["generated"]["seed"] == 0
    with pytest.raises(ValueError, match=r"measured with other settings \(the prepared data of "
                                         r"listops \(generated, splits\)"):
        run_stability(["listops"], ["kernelized"], cache_root=tmp_path / "cache",
                      earlier=earlier, **args)


@pytest.mark.parametrize("clip", [{"grad_clip": 1e-9}, {"grad_clip_value": 1e-9}])
def test_gradient_clipping_of_the_settings_applies_to_the_measured_steps(listops_cache, clip):
    """The paper measures Table 3 under Table 1's settings, and the reference code clips
    gradients: a clipping setting changes the update, so it changes tau."""
    plain = instability_taus(_cfg("kernelized"), listops_cache, steps=2)
    clipped = instability_taus(_cfg("kernelized", **clip), listops_cache, steps=2)
    assert clipped != pytest.approx(plain, rel=1e-3)


@pytest.mark.parametrize("setting, value", [("precision", "bf16"), ("grad_accum", 2)])
def test_settings_the_measurement_cannot_follow_are_refused(listops_cache, setting, value):
    with pytest.raises(ValueError, match=setting):
        instability_taus(_cfg("kernelized", **{setting: value}), listops_cache, steps=1)
    with pytest.raises(ValueError, match=setting):
        run_stability(["listops"], ["kernelized"], cache_root=listops_cache, steps=1,
                      overrides={"batch_size": 16, setting: value})


def test_table_3_orders_the_tasks_as_the_papers_do_whatever_order_they_were_asked_in():
    """--tasks retrieval listops gave the columns Retrieval, ListOps, where Table 1 and the
    papers have ListOps first: tables pasted side by side did not line up."""
    taus = {"softmax": {0: [1.0]}, "kernelized": {0: [0.5]}}
    report = StabilityReport(tasks=["retrieval", "listops"], methods=["kernelized"],
                             seeds=[0], steps=1,
                             taus={"retrieval": taus, "listops": {**taus, "kernelized": {
                                 0: [2.0]}}})
    table = format_table(report)
    assert "| model | ListOps | Retrieval |" in table and "| kernelized | 2.00 | 0.50 |" in table
