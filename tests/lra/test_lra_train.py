"""Training: learning, best-dev selection, exact resume, accumulation, precision, errors."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import torch
import torch.nn.functional as F

from skyformer.lra import load_cache, make_config, train
from skyformer.lra.batches import fetch
from skyformer.lra.checkpoint import load_checkpoint, save_checkpoint
from skyformer.lra.model import LRAClassifier, ModelConfig

TIME_FIELDS = ("seconds", "steps_per_second")


def _cfg(**overrides):
    base = {"steps": 12, "batch_size": 16, "lr": 3e-3, "warmup": 2, "eval_every": 4, "log_every": 3,
                "eval_batches": None, "attention": "softmax"}
    return make_config("listops", **{**base, **overrides})


def _run(cfg, cache, out, **kwargs):
    return train(cfg, cache_root=cache, out_dir=out, quiet=True, tensorboard=False, **kwargs)


def _history(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIME_FIELDS} for r in rows]


def _assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_tensors(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_loss_falls_and_the_best_dev_checkpoint_is_the_one_tested(listops_cache, tmp_path):
    result = _run(_cfg(steps=40, eval_every=10, log_every=10), listops_cache, tmp_path)
    rows = _history(tmp_path)
    train_losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert train_losses[-1] < train_losses[0] - 0.2, train_losses
    dev = [r for r in rows if r["kind"] == "dev"]
    best = max(dev, key=lambda r: (r["accuracy"], -r["step"]))
    assert result["best_step"] == best["step"]
    # Recompute the test accuracy and loss of best.pt independently of the training code.
    ckpt = load_checkpoint(tmp_path / "best.pt")
    assert ckpt["step"] == best["step"]
    model = LRAClassifier(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    test = load_cache(listops_cache, "listops").splits["test"]
    import numpy as np

    tokens, lengths, labels = fetch(test, np.arange(len(test)), torch.device("cpu"))
    with torch.no_grad():
        logits = model(tokens, lengths)
    accuracy = (logits.argmax(-1) == labels).float().mean().item()
    assert result["test_accuracy"] == pytest.approx(accuracy)
    # the mean over examples, not over batches (the batches are smaller than the split)
    assert len(test) > _cfg().batch_size
    assert result["test_loss"] == pytest.approx(F.cross_entropy(logits, labels).item())
    assert result["test_accuracy"] > 0.2  # 10 classes, about uniform: chance is ~0.1
    for name in ("config.json", "train.csv", "dev.csv", "result.json", "last.pt"):
        assert (tmp_path / name).is_file()
    assert result["config"]["attention"] == "softmax" and result["peak_memory_bytes"] > 0
    # every option it ran with, the defaults too: the report needs no registry for them
    assert result["attention_ran_with"] == {"scale": None, "causal": False}
    assert result["diverged_at_step"] is None


def test_resume_reproduces_an_uninterrupted_run_exactly(listops_cache, tmp_path):
    """Dropout, randomised attention (landmarks), data order across epochs, the learning-rate
    schedule and partial log sums all continue as if never interrupted."""
    cfg = _cfg(attention="skyformer", attention_options={"num_features": 4}, steps=20,
               checkpoint_every=5, batch_size=32)  # 8 batches per epoch: crosses epochs
    whole = _run(cfg, listops_cache, tmp_path / "whole")
    assert _run(cfg, listops_cache, tmp_path / "cut", stop_after=5) is None
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["state"]["step"] == 5
    # Entries an interrupted run logged after its last checkpoint must disappear.
    with (tmp_path / "cut" / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"kind": "train", "step": 6, "loss": 99.0}) + "\n")
    resumed = _run(cfg, listops_cache, tmp_path / "cut", resume=True)
    a = load_checkpoint(tmp_path / "whole" / "last.pt")
    b = load_checkpoint(tmp_path / "cut" / "last.pt")
    _assert_same_tensors(a["model"], b["model"])
    _assert_same_tensors(a["optimizer"], b["optimizer"])
    _assert_same_tensors(a["rng"]["processes"][0], b["rng"]["processes"][0])
    assert _history(tmp_path / "whole") == _history(tmp_path / "cut")
    _assert_same_tensors(load_checkpoint(tmp_path / "whole" / "best.pt")["model"],
                         load_checkpoint(tmp_path / "cut" / "best.pt")["model"])
    assert whole["test_accuracy"] == resumed["test_accuracy"]
    assert whole["best_step"] == resumed["best_step"]

    # Control: the same resume with the dropout generator re-seeded ends elsewhere.
    _run(cfg, listops_cache, tmp_path / "control", stop_after=5)
    ckpt = load_checkpoint(tmp_path / "control" / "last.pt")
    ckpt["rng"]["processes"][0]["torch"] = torch.manual_seed(123).get_state()
    save_checkpoint(tmp_path / "control" / "last.pt", ckpt)
    _run(cfg, listops_cache, tmp_path / "control", resume=True)
    c = load_checkpoint(tmp_path / "control" / "last.pt")
    assert not torch.equal(a["model"]["head.0.weight"], c["model"]["head.0.weight"])


def test_a_resume_may_log_and_checkpoint_at_other_steps(listops_cache, tmp_path):
    """--log-every and --checkpoint-every change no step's arithmetic: a run resumed with
    others ends where the uninterrupted one does, logging at the new steps from there."""
    cfg = _cfg(steps=8, eval_every=4, checkpoint_every=2, log_every=2)
    whole = _run(cfg, listops_cache, tmp_path / "whole")
    _run(cfg, listops_cache, tmp_path / "cut", stop_after=2)
    later = dataclasses.replace(cfg, log_every=3, checkpoint_every=4)
    resumed = _run(later, listops_cache, tmp_path / "cut", resume=True)
    _assert_same_tensors(load_checkpoint(tmp_path / "whole" / "last.pt")["model"],
                         load_checkpoint(tmp_path / "cut" / "last.pt")["model"])
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert [r["step"] for r in _history(tmp_path / "cut") if r["kind"] == "train"] == [2, 3, 6]
    assert resumed["config"]["log_every"] == 3  # the run's last settings


def test_csv_files_hold_only_the_entries_of_the_run_being_continued(listops_cache, tmp_path):
    """A CSV of a kind the checkpoint has no entries of yet (dev before the first
    evaluation) loses the rows logged after that checkpoint, as metrics.jsonl does; a new
    run in a folder left by an attempt without a checkpoint starts with none."""
    cfg = _cfg(steps=8, eval_every=4, checkpoint_every=2, log_every=2)
    folder = tmp_path / "cut"
    _run(cfg, listops_cache, folder, stop_after=2)
    early = load_checkpoint(folder / "last.pt")
    _run(cfg, listops_cache, folder, stop_after=6, resume=True)  # dev logged at step 4
    assert "4," in (folder / "dev.csv").read_text()
    save_checkpoint(folder / "last.pt", early)  # as if interrupted before the step-4 one
    _run(cfg, listops_cache, folder, stop_after=3, resume=True)
    assert not (folder / "dev.csv").exists()
    assert [r["step"] for r in _history(folder)] == [2]
    assert [row.split(",")[0] for row in (folder / "train.csv").read_text().split()[1:]] == ["2"]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text((folder / "config.json").read_text())  # written first
    for kind in ("train", "dev", "test"):
        (fresh / f"{kind}.csv").write_text("step,accuracy\n99,1.0\n")
    _run(cfg, listops_cache, fresh, stop_after=1)
    assert sorted(p.name for p in fresh.glob("*.csv")) == []


def test_an_existing_run_needs_resume_and_the_same_settings(listops_cache, tmp_path):
    cfg = _cfg(steps=4)
    _run(cfg, listops_cache, tmp_path)
    with pytest.raises(ValueError, match=r"already holds a run.*--resume"):
        _run(cfg, listops_cache, tmp_path)
    with pytest.raises(ValueError, match=r"the settings differ from the run's \(lr: 0.003 "
                       r"then, 0.001 now\); resume with the same settings"):
        _run(dataclasses.replace(cfg, lr=1e-3), listops_cache, tmp_path, resume=True)
    other = dataclasses.replace(cfg, batch_size=8, attention_options={"scale": 0.5})
    with pytest.raises(ValueError, match=r'\(attention_options: \{\} then, \{"scale": 0.5\} now, '
                       r"batch_size: 16 then, 8 now\)"):
        _run(other, listops_cache, tmp_path, resume=True)
    again = _run(cfg, listops_cache, tmp_path, resume=True)  # finished: its stored result.json
    assert again["steps"] == 4
    # one setting written two ways (a variant's brackets, or options) is the same run
    bracketed = _cfg(steps=2, attention="softmax[scale=0.5]")
    _run(bracketed, listops_cache, tmp_path / "variant", stop_after=1)
    given = dataclasses.replace(bracketed, attention="softmax",
                                attention_options={"scale": 0.5})
    assert _run(given, listops_cache, tmp_path / "variant", resume=True)["steps"] == 2


def test_a_new_run_refuses_the_files_of_an_earlier_run_without_last_pt(listops_cache, tmp_path):
    """Checkpoints deleted after a run: a new run there (fresh or --resume of other
    settings) would leave the earlier result.json, which `lra report` reads, beside its
    own files; --resume of its own settings finds it finished (it was refused, blocking
    the later seeds of a --seeds command)."""
    cfg = _cfg(steps=4, eval_every=2)
    _run(cfg, listops_cache, tmp_path)
    before = (tmp_path / "result.json").read_text()
    for name in ("last.pt", "best.pt"):
        (tmp_path / name).unlink()
    for resume in (False, True):
        with pytest.raises(ValueError, match=r"holds files of an earlier run \(result.json, "
                           r"metrics.jsonl\) but no last.pt .*choose another --out \(to "
                           r"discard that run instead, remove those files\)"):
            _run(dataclasses.replace(cfg, lr=1e-2), listops_cache, tmp_path, resume=resume)
    # resumed with its own settings, the run is finished: its result stands, nothing trains
    assert _run(cfg, listops_cache, tmp_path, resume=True) == json.loads(before)
    assert not (tmp_path / "last.pt").exists()
    assert (tmp_path / "result.json").read_text() == before
    (tmp_path / "result.json").unlink()
    with pytest.raises(ValueError, match=r"earlier run \(metrics.jsonl\)"):
        _run(cfg, listops_cache, tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    assert _run(cfg, listops_cache, tmp_path)["steps"] == 4


@pytest.mark.parametrize("files", [
    {"train.csv": "id,text,label\n1,hi,0\n", "test.csv": "id,text,label\n"},
    {"config.json": '{"model_type": "bert"}'},
    {"config.json": "not json", "metrics.jsonl": ""},
])
def test_a_new_run_leaves_files_of_a_runs_names_that_no_run_wrote(listops_cache, tmp_path,
                                                                  files):
    """--out at a dataset's folder deleted its train/dev/test.csv (no entries of those
    kinds) and wrote over its config.json, without a word."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=rf"{tmp_path} holds .*{sorted(files)[-1]}.*, which "
                                         r"a run writes over or removes, and no config.json "
                                         r"of a run: .*choose another --out"):
        _run(_cfg(steps=2, eval_every=2), listops_cache, tmp_path)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files


def test_an_attempt_killed_in_its_first_checkpoint_is_started_again(listops_cache, tmp_path,
                                                                      monkeypatch):
    """The first dev entry is logged before the first last.pt is written: an attempt
    killed there left metrics.jsonl with a dev entry, which was refused as an earlier
    run's files; it is replaced by a new run, fresh or with --resume."""
    import importlib

    lra_train = importlib.import_module("skyformer.lra.train")  # the module, not train()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    cfg = _cfg(steps=4, eval_every=2)
    monkeypatch.setattr(lra_train, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, listops_cache, tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / "last.pt").exists() and (tmp_path / "metrics.jsonl").exists()
    assert _run(cfg, listops_cache, tmp_path, resume=True)["steps"] == 4


def test_a_new_run_hides_the_tensorboard_events_of_an_attempt_without_checkpoint(
        listops_cache, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(_cfg(steps=6, eval_every=4, log_every=1), cache_root=listops_cache, out_dir=tmp_path,
          quiet=True, stop_after=3)
    (tmp_path / "last.pt").unlink()  # as if it died before its first checkpoint
    train(_cfg(steps=6, eval_every=4, log_every=2), cache_root=listops_cache, out_dir=tmp_path,
          quiet=True)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]


def test_gradient_accumulation_matches_the_full_batch(listops_cache, tmp_path):
    cfg = _cfg(steps=3, dropout=0.0, eval_every=3)
    _run(cfg, listops_cache, tmp_path / "full")
    _run(dataclasses.replace(cfg, grad_accum=4), listops_cache, tmp_path / "accum")
    a = load_checkpoint(tmp_path / "full" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "accum" / "last.pt")["model"]
    # Adam divides by sqrt(v): for near-zero gradients the order of summation shows up at
    # ~1e-6, against updates of lr = 3e-3 per step.
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=2e-5)
    assert not torch.equal(a["head.0.weight"], _initial_head(listops_cache))
    with pytest.raises(ValueError, match="not divisible by processes x accumulation"):
        _run(dataclasses.replace(cfg, grad_accum=3), listops_cache, tmp_path / "bad")


def test_performer_redraws_per_step_whatever_the_accumulation(listops_cache, tmp_path):
    """Each micro-batch counted as a call: with --grad-accum 2 the features were redrawn
    twice as often as without, in steps (and, with an odd count, between the
    micro-batches of one step)."""
    cfg = _cfg(steps=3, eval_every=3, attention="performer",
               attention_options={"num_features": 4, "feature_redraw_interval": 1})
    redraws = []
    for accumulation in (1, 2):
        _run(dataclasses.replace(cfg, grad_accum=accumulation), listops_cache,
             tmp_path / str(accumulation))
        model = load_checkpoint(tmp_path / str(accumulation) / "last.pt")["model"]
        redraws.append(sorted(int(v) for k, v in model.items() if k.endswith(".redraws")))
    assert redraws[0] == redraws[1] and redraws[0][0] == 2  # before steps 2 and 3


def _initial_head(cache):
    torch.manual_seed(0)
    data = load_cache(cache, "listops")
    from skyformer.lra.train import model_config

    return LRAClassifier(model_config(_cfg(), data)).state_dict()["head.0.weight"]


def test_patience_stops_when_dev_accuracy_stalls(listops_cache, tmp_path):
    result = _run(_cfg(steps=40, lr=1e-12, eval_every=2, patience=2), listops_cache, tmp_path)
    assert result["steps"] == 6  # first evaluation sets the best, two more without gain


def test_bf16_autocast_on_cpu_and_fp16_refused(listops_cache, tmp_path):
    result = _run(_cfg(steps=2, eval_every=2, precision="bf16"), listops_cache, tmp_path / "bf16")
    assert 0.0 <= result["test_accuracy"] <= 1.0
    with pytest.raises(ValueError, match="fp16 autocast needs a CUDA device"):
        _run(_cfg(steps=2, precision="fp16"), listops_cache, tmp_path / "fp16", device="cpu")
    # before the data: a user without prepared data learns first that fp16 needs CUDA
    with pytest.raises(ValueError, match="fp16 autocast needs a CUDA device"):
        _run(_cfg(steps=2, precision="fp16"), tmp_path / "no-data", tmp_path / "fp16b",
             device="cpu")


def test_settings_are_validated_with_sentences(listops_cache, tmp_path):
    with pytest.raises(ValueError, match="unknown training setting"):
        make_config("listops", learning_rate=1)
    with pytest.raises(ValueError, match=r"precision \(--precision\) must be one of"):
        make_config("listops", precision="fp8")
    with pytest.raises(ValueError,
                       match=r"seed \(--seed\) must be an integer from 0 to 2\^64 - 1, got -1"):
        make_config("listops", seed=-1)
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:K, got 'tpu'"):
        _run(_cfg(), listops_cache, tmp_path / "tpu", device="tpu")
    with pytest.raises(ValueError, match="exceeds the prepared length 8"):
        _run(_cfg(max_len=9), listops_cache, tmp_path)
    with pytest.raises(FileNotFoundError, match="skyformer lra prepare text"):
        train(make_config("text", quick=True), cache_root=listops_cache, out_dir=tmp_path / "t")


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("lr", float("inf"), "lr (--lr) must be a positive finite number, got inf."),
    ("lr", float("nan"), "lr (--lr) must be a positive finite number, got nan."),
    ("weight_decay", float("inf"),
     "weight_decay (--weight-decay) must be a finite number >= 0, got inf."),
    ("weight_decay", float("nan"),
     "weight_decay (--weight-decay) must be a finite number >= 0, got nan."),
])
def test_an_infinite_or_nan_lr_or_weight_decay_is_refused(setting, value, message):
    """inf trained NaN weights to the end and exited 0; weight decay NaN got torch's error."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config("listops", **{setting: value})


def test_tensorboard_events_and_purge_on_resume(listops_cache, tmp_path):
    """A run that goes on after its last checkpoint and then dies: on resume, both the
    metrics files and TensorBoard drop what it logged after the checkpoint."""
    pytest.importorskip("tensorboard")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(steps=6, eval_every=2, log_every=2)
    train(cfg, cache_root=listops_cache, out_dir=tmp_path, quiet=True, stop_after=4)
    shutil.copy(tmp_path / "last.pt", tmp_path / "at4.pt")
    train(cfg, cache_root=listops_cache, out_dir=tmp_path, quiet=True, resume=True)
    shutil.copy(tmp_path / "at4.pt", tmp_path / "last.pt")  # as if it died after step 4
    train(cfg, cache_root=listops_cache, out_dir=tmp_path, quiet=True, resume=True)
    events = EventAccumulator(str(tmp_path / "tensorboard"))  # purges as TensorBoard does
    events.Reload()
    assert {"train/loss", "dev/accuracy", "test/accuracy"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("dev/accuracy")] == [2, 4, 6]
    assert [r["step"] for r in _history(tmp_path) if r["kind"] == "dev"] == [2, 4, 6]


@pytest.mark.parametrize("payload", [[1, 2, 3], {"format": 1}, {"format": 12345}])
def test_resume_from_a_foreign_last_pt_gets_a_sentence(listops_cache, tmp_path, payload):
    import torch

    from skyformer.lra.checkpoint import save_checkpoint

    cfg = _cfg(steps=2, checkpoint_every=1)
    tmp_path.mkdir(exist_ok=True)
    if isinstance(payload, dict):
        save_checkpoint(tmp_path / "last.pt", payload)
    else:
        torch.save(payload, tmp_path / "last.pt")
    with pytest.raises(ValueError, match=r"not a training checkpoint|lacks"):
        _run(cfg, listops_cache, tmp_path, resume=True)


def _damage(path, kind):
    """Make ``path`` (a checkpoint) cut short, empty, text, or a pickle with an object."""
    import argparse

    if kind == "cut short":
        path.write_bytes(path.read_bytes()[:2000])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text('{"format": 1}\n')
    else:
        torch.save({"format": 1, "args": argparse.Namespace(lr=1)}, path)


@pytest.mark.parametrize("kind, says", [
    ("cut short", "cut short, empty or not written by torch.save"),
    ("empty", "cut short, empty or not written by torch.save"),
    ("text", "cut short, empty or not written by torch.save"),
    ("object", r"a Python object \(argparse.Namespace\) .* not loaded"),
])
def test_an_unreadable_last_pt_is_named_with_what_to_do(listops_cache, tmp_path, kind, says):
    """Not torch's paragraph advising weights_only=False, which --resume cannot take."""
    cfg = _cfg(steps=2, checkpoint_every=1)
    _run(cfg, listops_cache, tmp_path, stop_after=1)
    _damage(tmp_path / "last.pt", kind)
    with pytest.raises(ValueError, match=says) as caught:
        _run(cfg, listops_cache, tmp_path, resume=True)
    assert str(caught.value).endswith("or start a new run with another --out.")
    assert "weights_only" not in str(caught.value)


@pytest.mark.parametrize("other", [{"seed": 1}, {"attention": "linear"}])
def test_a_best_pt_of_another_run_is_refused_not_tested_as_this_runs(listops_cache, tmp_path,
                                                                     other):
    """best.pt put back from another seed's or method's folder (same step) was evaluated
    on test at the end and written to result.json as this run's."""
    cfg = _cfg(steps=8)
    _run(cfg, listops_cache, tmp_path / "run", stop_after=4)
    _run(dataclasses.replace(cfg, **other), listops_cache, tmp_path / "other", stop_after=4)
    (tmp_path / "other" / "best.pt").replace(tmp_path / "run" / "best.pt")
    key, value = next(iter(other.items()))
    with pytest.raises(ValueError, match=rf"best.pt is the best checkpoint of a run with other "
                       rf"settings \({key}: {value} then, .* now\)"):
        _run(cfg, listops_cache, tmp_path / "run", resume=True)
    assert not (tmp_path / "run" / "result.json").exists()
    torch.save(torch.zeros(2), tmp_path / "run" / "best.pt")
    with pytest.raises(ValueError, match=r"best\.pt is not a best-dev checkpoint"):
        _run(cfg, listops_cache, tmp_path / "run", resume=True)


def test_a_best_pt_of_another_step_or_other_data_is_refused(listops_cache, tmp_path):
    """best.pt of this run's settings from another run (other prepared data) or from an
    earlier step of this run: the other step was a warning, after which the end of the
    run tested that model and wrote it to result.json as this run's best; the other data
    went unseen (best.pt recorded none)."""
    cfg = _cfg(steps=12, eval_every=2, log_every=2)
    _run(cfg, listops_cache, tmp_path / "run", stop_after=2)
    early = tmp_path / "early.pt"
    early.write_bytes((tmp_path / "run" / "best.pt").read_bytes())
    _run(cfg, listops_cache, tmp_path / "run", resume=True, stop_after=8)
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    state = load_checkpoint(tmp_path / "run" / "last.pt")["state"]
    if best["step"] == 2 or state["best_step"] == state["step"]:
        pytest.skip("the best dev step is 2 or the last one here: no other step to put back")
    kept = (tmp_path / "run" / "best.pt").read_bytes()
    early.replace(tmp_path / "run" / "best.pt")
    with pytest.raises(ValueError, match=rf"best\.pt holds step 2, not step {best['step']} "
                                         rf"where this run has its best dev accuracy"):
        _run(cfg, listops_cache, tmp_path / "run", resume=True)
    moved = dict(best, data={**best["data"], "examples": -1})
    save_checkpoint(tmp_path / "run" / "best.pt", moved)
    with pytest.raises(ValueError, match=r"best\.pt is the best checkpoint of a run on other "
                                         r"prepared data"):
        _run(cfg, listops_cache, tmp_path / "run", resume=True)
    (tmp_path / "run" / "best.pt").write_bytes(kept)
    assert _run(cfg, listops_cache, tmp_path / "run", resume=True)["best_step"] == best["step"]


def test_a_best_pt_recorded_before_split_digests_resumes_on_the_same_data(
        listops_cache, tmp_path):
    """A run whose records (last.pt's and best.pt's) lack the split digests a later
    preparation of the same files adds resumes, as last.pt's check lets it: best.pt's
    compared them exactly and refused it as 'other prepared data'."""
    cfg = _cfg(steps=6, eval_every=2, log_every=2)
    _run(cfg, listops_cache, tmp_path, stop_after=2)
    for name in ("last.pt", "best.pt"):
        ckpt = load_checkpoint(tmp_path / name)
        for split in ckpt["data"]["splits"].values():
            split.pop("sha256")
        save_checkpoint(tmp_path / name, ckpt)
    assert _run(cfg, listops_cache, tmp_path, resume=True)["steps"] == 6


@pytest.mark.parametrize("text, says", [('{"test_acc', "not JSON"), ("[1]", "a JSON list"),
                                         (b"\xff\xfe", "not JSON")])
def test_an_unreadable_result_json_is_named_at_resume(listops_cache, tmp_path, text, says):
    """It gave json's bare 'Unterminated string ...' without a file, or an AttributeError."""
    cfg = _cfg(steps=8)
    _run(cfg, listops_cache, tmp_path, stop_after=4)
    path = tmp_path / "result.json"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ValueError, match=rf"its result.json is {says}.*remove it"):
        _run(cfg, listops_cache, tmp_path, resume=True)


@pytest.mark.parametrize("resume", [False, True])
def test_a_second_run_in_a_folder_in_use_is_refused(listops_cache, tmp_path, resume):
    """Two runs started in one folder before either wrote last.pt (or two --resume of
    one run) both trained there, each writing over and between the other's files."""
    from skyformer.io import LOCK_FILE, folder_lock

    cfg = _cfg(steps=8)
    if resume:
        _run(cfg, listops_cache, tmp_path, stop_after=4)
    with folder_lock(tmp_path):  # the run training there now
        with pytest.raises(ValueError, match=rf"is in use by another run \(process \d+ on "
                           rf".*holds .*{re.escape(LOCK_FILE)}\); wait for it to end"):
            _run(cfg, listops_cache, tmp_path, resume=resume)
        assert not (tmp_path / "result.json").exists()
    assert _run(cfg, listops_cache, tmp_path, resume=resume)["steps"] == 8
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_lock_a_killed_run_left_is_taken_over(listops_cache, tmp_path):
    import subprocess
    import sys

    from skyformer.io import LOCK_FILE
    from skyformer.io.processes import builder_tag

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = builder_tag().rsplit("-", 1)[0]
    (tmp_path / LOCK_FILE).write_text(f"{host}-{dead}\n")
    assert _run(_cfg(steps=4), listops_cache, tmp_path)["steps"] == 4
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text(f"another-host-{dead}\n")  # alive there, maybe
    with pytest.raises(ValueError, match=rf"process {dead} on another-host holds"):
        _run(_cfg(steps=4), listops_cache, tmp_path, resume=True)


def test_a_run_stopped_early_is_finished_on_resume_without_training(listops_cache, tmp_path,
                                                                   monkeypatch):
    """Interrupted between early stopping and result.json: resume evaluates, trains no
    more, and names its peak as the uninterrupted run does (a new process, whose peak
    counter was never reset, called it the whole process's)."""
    from skyformer.lra import metrics

    cfg = _cfg(steps=40, lr=1e-12, eval_every=2, patience=2)
    whole = _run(cfg, listops_cache, tmp_path)
    (tmp_path / "result.json").unlink()
    monkeypatch.setitem(metrics._cpu_reset, "done", False)  # as in a new process
    resumed = _run(cfg, listops_cache, tmp_path, resume=True)
    assert resumed["peak_memory_kind"] == whole["peak_memory_kind"]
    assert resumed["steps"] == whole["steps"] == 6
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert load_checkpoint(tmp_path / "last.pt")["state"]["step"] == 6


def test_a_finished_run_resumed_with_other_logging_settings_is_left_as_it_is(
        listops_cache, tmp_path, monkeypatch):
    """--log-every and --checkpoint-every may change at resume; a finished run resumed
    with them was evaluated again and its result.json written again."""
    import importlib

    cfg = _cfg(steps=4, eval_every=2, log_every=2)
    _run(cfg, listops_cache, tmp_path)
    written = (tmp_path / "result.json").read_bytes()
    lra_train = importlib.import_module("skyformer.lra.train")
    monkeypatch.setattr(lra_train, "evaluate", lambda *a, **k: pytest.fail("evaluated again"))
    again = _run(dataclasses.replace(cfg, log_every=3, checkpoint_every=4), listops_cache,
                 tmp_path, resume=True)
    assert (tmp_path / "result.json").read_bytes() == written
    assert again["config"]["log_every"] == 2


def test_numpy_settings_train_to_a_result(listops_cache, tmp_path):
    """A sweep's NumPy scalars (np.logspace learning rates, np.arange budgets) went into
    every checkpoint, which torch.load(weights_only=True) refuses: the run trained to its
    end and failed reading its own best.pt, with no result.json."""
    import numpy as np

    cfg = _cfg(steps=4, eval_every=2, lr=np.float64(3e-3), attention="skyformer",
               attention_options={np.str_("num_features"): np.int64(4)}, seed=np.int64(1),
               weight_decay=np.array(0.0))
    assert type(cfg.lr) is float and type(cfg.weight_decay) is float
    (name, value), = cfg.attention_options.items()
    assert type(name) is str and type(value) is int
    result = _run(cfg, listops_cache, tmp_path)
    assert result["steps"] == 4 and (tmp_path / "result.json").exists()


def test_a_checkpoint_of_another_device_type_resumes_with_reseeded_draws(
        listops_cache, tmp_path, caplog):
    """A CUDA generator's state is 16 bytes, a CPU one's 5056: a run stopped on a CPU node
    and resumed on a GPU node (or the other way) failed in Generator.set_state. Its
    draws are reseeded, as for another process count, with a warning --quiet keeps."""
    import struct

    cfg = _cfg(steps=4, eval_every=2, attention="performer")
    _run(cfg, listops_cache, tmp_path, stop_after=2)
    ckpt = load_checkpoint(tmp_path / "last.pt")
    cuda_state = torch.frombuffer(bytearray(struct.pack("<Qq", 1234, 0)), dtype=torch.uint8)
    ckpt["rng"]["processes"][0].update(attention=cuda_state.clone(), cuda=cuda_state.clone())
    save_checkpoint(tmp_path / "last.pt", ckpt)
    with caplog.at_level(logging.WARNING, logger="skyformer"):
        result = _run(cfg, listops_cache, tmp_path, resume=True)
    assert result["steps"] == 4
    assert re.search(r"resuming on cpu a run whose checkpoint was written on another "
                     r"device type: .* reseeded", caplog.text)


def test_a_diverged_run_writes_strict_json_and_resumes_as_finished(
        listops_cache, tmp_path, monkeypatch, caplog):
    """A run whose loss became NaN (here: an infinite learning rate from the schedule)
    writes null for every non-finite number (metrics.jsonl, result.json and config.json
    are strict JSON, grad_clip = inf too); resumed, it is found finished (its config,
    read back with null for inf, is the same) and the report reads it. The divergence is
    said once while it trains, recorded, and noted by the report (it was reported as an
    ordinary result), and its accuracies are 0, not the share of class 0."""
    import importlib

    from skyformer.lra.report import collect_runs, tables
    from skyformer.lra.train import Trainer

    def strict(text):
        return json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} written"))

    lra_train = importlib.import_module("skyformer.lra.train")  # the package's train is a function
    monkeypatch.setattr(lra_train, "learning_rate", lambda step, cfg: float("inf"))
    cfg = _cfg(steps=4, grad_clip=float("inf"), eval_every=2, log_every=2)
    with caplog.at_level(logging.WARNING, logger="skyformer"):
        _run(cfg, listops_cache, tmp_path)
    said = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the training loss is nan by step 2: the run "
                                                 "diverged (a lower --lr")
    result = strict((tmp_path / "result.json").read_text())
    assert result["test_loss"] is None and result["config"]["grad_clip"] is None
    assert result["diverged_at_step"] == 2
    assert strict((tmp_path / "config.json").read_text())["train"]["grad_clip"] is None
    entries = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in entries] == ["train", "dev", "train", "dev", "test"]
    assert all(e["loss"] is None for e in entries)
    # NaN logits pick no class (argmax gave class 0: the share of that class was scored)
    # (the first step's logits were finite, before the first update)
    assert all(e["accuracy"] == 0 for e in entries[1:]) and result["test_accuracy"] == 0
    monkeypatch.setattr(Trainer, "_finish", lambda self: pytest.fail("evaluated again"))
    assert _run(cfg, listops_cache, tmp_path, resume=True) == result
    report = tables(collect_runs([tmp_path]))
    assert "| softmax (batch_size=16, eval_every=2, lr=0.003, max_len=8, " \
        "steps=4, warmup=2) |" in report
    assert "diverged (training loss not finite) in seed(s) 0 at step 2; its numbers are " \
        "of the best dev checkpoint" in report


def test_resume_refuses_other_prepared_data_with_a_sentence(tmp_path):
    from skyformer.lra import prepare, write_listops
    from tests.lra.release_files import TINY_RULES

    for seed in (0, 1):
        write_listops(tmp_path / f"src{seed}", train=64, dev=16, test=16, rules=TINY_RULES,
                      seed=seed)

    def prepare_from(seed, max_len=8, **options):
        prepare("listops", tmp_path / f"src{seed}", tmp_path / "cache", max_len=max_len,
                **options)

    cfg, run = _cfg(steps=4), tmp_path / "run"
    prepare_from(0)
    _run(cfg, tmp_path / "cache", run, stop_after=2)
    prepare_from(1)
    with pytest.raises(ValueError, match=r"prepared listops data .* differs from the data the "
                       r"run started with \(meta.json: generated, splits\); prepare it again"):
        _run(cfg, tmp_path / "cache", run, resume=True)
    prepare_from(0, max_len=10)
    with pytest.raises(ValueError, match=r"max_len: 8 then, 10 now.*again as it was with "
                       r"--max-len 8"):
        _run(cfg, tmp_path / "cache", run, resume=True)
    prepare_from(0, tokens="reference")
    with pytest.raises(ValueError, match=r"meta.json: .*tokens: the release's \(no "
                                         r"--listops-tokens\) then, reference now"):
        _run(cfg, tmp_path / "cache", run, resume=True)
    prepare_from(0, tokens="reference")  # a run on reference tokens, resumed on the release's
    other = tmp_path / "reference_run"
    _run(cfg, tmp_path / "cache", other, stop_after=2)
    prepare_from(0)
    with pytest.raises(ValueError, match=r"prepare it again as it was with --listops-tokens "
                                         r"reference,"):
        _run(cfg, tmp_path / "cache", other, resume=True)
    prepare_from(0)  # the same files prepared again: the run goes on
    assert _run(cfg, tmp_path / "cache", run, resume=True, stop_after=3) is None
    # A checkpoint without a fingerprint (older versions): the model's shape is checked.
    ckpt = load_checkpoint(run / "last.pt")
    del ckpt["data"]
    save_checkpoint(run / "last.pt", ckpt)
    prepare_from(0, max_len=10)
    with pytest.raises(ValueError, match=r"the model built for .* differs from the run's "
                       r"\(max_len: 8 then, 10 now\)"):
        _run(cfg, tmp_path / "cache", run, resume=True)
    prepare_from(0)
    assert _run(cfg, tmp_path / "cache", run, resume=True)["steps"] == 4


def _scripted_dev(monkeypatch, accuracies):
    """Dev accuracy by step from ``accuracies`` (a dict the test may swap), crash on
    entering a step in ``accuracies["crash"]``."""
    import importlib

    lra_train = importlib.import_module("skyformer.lra.train")  # the package's train is a function
    step = {"now": 0}
    train_step = lra_train.Trainer._train_step

    def stepping(self):
        if self.state.step + 1 in accuracies.get("crash", ()):
            raise RuntimeError("crash")
        train_step(self)
        step["now"] = self.state.step

    def evaluate(model, split, **kwargs):
        return {"accuracy": accuracies.get(step["now"], 0.0), "loss": 1.0, "count": len(split)}

    monkeypatch.setattr(lra_train.Trainer, "_train_step", stepping)
    monkeypatch.setattr(lra_train, "evaluate", evaluate)


def test_best_pt_is_never_from_steps_after_the_checkpoint_resumed(
        listops_cache, tmp_path, monkeypatch):
    """A dev improvement at step 3, after the step-2 checkpoint, then a crash. The resumed
    run may take another path (another number of processes reseeds dropout and attention):
    the best.pt it tests must be a model of its own history, the one ``best_step`` names."""
    cfg = _cfg(steps=4, eval_every=1, checkpoint_every=2, log_every=1)
    accuracies = {1: 0.5, 2: 0.6, 3: 0.9, "crash": {4}}
    _scripted_dev(monkeypatch, accuracies)
    with pytest.raises(RuntimeError, match="crash"):
        _run(cfg, listops_cache, tmp_path)
    accuracies.clear()
    accuracies.update({3: 0.55, 4: 0.58})  # the other path: no step beats 0.6 of step 2
    result = _run(cfg, listops_cache, tmp_path, resume=True)
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == result["best_step"]
    dev = {r["step"]: r["accuracy"] for r in _history(tmp_path) if r["kind"] == "dev"}
    assert best["dev"]["accuracy"] == dev[best["step"]] == max(dev.values())


def test_a_run_interrupted_between_last_pt_and_best_pt_writes_best_pt_on_resume(
        listops_cache, tmp_path, monkeypatch):
    import importlib

    lra_train = importlib.import_module("skyformer.lra.train")
    cfg = _cfg(steps=4, eval_every=1, checkpoint_every=2, log_every=1)
    _scripted_dev(monkeypatch, {1: 0.5, 2: 0.6, 3: 0.9, 4: 0.58})
    save_best = lra_train.Trainer._save_best

    def interrupted(self, dev):
        if self.state.step == 3:
            raise RuntimeError("crash")
        save_best(self, dev)

    monkeypatch.setattr(lra_train.Trainer, "_save_best", interrupted)
    with pytest.raises(RuntimeError, match="crash"):
        _run(cfg, listops_cache, tmp_path)
    assert load_checkpoint(tmp_path / "last.pt")["state"]["best_step"] == 3
    monkeypatch.setattr(lra_train.Trainer, "_save_best", save_best)
    result = _run(cfg, listops_cache, tmp_path, resume=True)
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == result["best_step"] == 3 and best["dev"]["accuracy"] == 0.9


def test_an_evaluation_that_fails_leaves_the_model_in_training_mode(monkeypatch):
    """Out of memory or an interruption inside an evaluation: the caller's model is back
    in the mode it was in (training), not left in eval mode for the steps after."""
    from torch import nn

    from skyformer.lra import evaluate as evaluation
    from skyformer.lra.distributed import DistInfo

    class OutOfMemory(nn.Module):
        def forward(self, tokens, lengths, generator=None):
            assert not torch.is_grad_enabled(), "an evaluation records no gradient"
            raise RuntimeError("out of memory")

    monkeypatch.setattr(evaluation, "fetch", lambda split, rows, device, max_len: (
        torch.zeros(len(rows), 4, dtype=torch.long), torch.full((len(rows),), 4),
        torch.zeros(len(rows), dtype=torch.long)))
    model = OutOfMemory().train()
    with pytest.raises(RuntimeError, match="out of memory"):
        evaluation.evaluate(model, [0, 1, 2], batch_size=2, device=torch.device("cpu"),
                            info=DistInfo(), seed=0)
    assert model.training


@pytest.mark.parametrize("clip", ["grad_clip", "grad_clip_value"])
def test_gradients_are_clipped_before_the_optimizer_step(listops_cache, tmp_path, monkeypatch,
                                                          clip):
    """grad_clip bounds the norm of all gradients, grad_clip_value each entry (as the
    reference code's clip at 1), both on the unscaled gradients, before AdamW steps."""
    seen = []
    step = torch.optim.AdamW.step

    def record(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        seen.append((torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(),
                     max(g.abs().max().item() for g in grads)))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    _run(_cfg(steps=2, eval_every=2, **{clip: 1e-3}), listops_cache, tmp_path / "clipped")
    norm, largest = seen[-1]
    if clip == "grad_clip":
        assert norm == pytest.approx(1e-3, rel=1e-4)
    else:
        assert largest == pytest.approx(1e-3) and norm > 1e-3
    seen.clear()
    _run(_cfg(steps=2, eval_every=2), listops_cache, tmp_path / "free")
    assert seen[-1][1] > 1e-2, "without clipping, the gradients are larger than the bound"


def test_two_ways_to_clip_are_refused_together():
    with pytest.raises(ValueError, match=r"grad_clip .* and grad_clip_value .* are both set; give "
                       r"one way to clip gradients"):
        _cfg(grad_clip=1.0, grad_clip_value=1.0)
    with pytest.raises(ValueError, match=r"grad_clip_value \(--grad-clip-value\) must be "
                                         r"positive or None, got 0"):
        _cfg(grad_clip_value=0)


def test_resume_without_best_pt_is_refused_before_training(listops_cache, tmp_path, monkeypatch):
    """best.pt deleted (or lost) mid-run: the resumed run trained to the end, then failed
    reading it; it is refused at once, by check_run (--seeds) too. A finished run needs
    no best.pt to be found finished."""
    import importlib

    from skyformer.lra.train import check_run

    lra_train = importlib.import_module("skyformer.lra.train")
    cfg = _cfg(steps=6, eval_every=2)
    _scripted_dev(monkeypatch, {2: 0.9, 4: 0.5})  # best at step 2: last.pt is not the best
    _run(cfg, listops_cache, tmp_path, stop_after=4)
    (tmp_path / "best.pt").unlink()
    monkeypatch.setattr(lra_train.Trainer, "_train_step",
                        lambda self: pytest.fail("trained without best.pt"))
    message = (r"cannot resume .*last.pt: best.pt, the checkpoint of its best dev result \(step "
               r"2\) that the run evaluates on test at its end, is missing; put it back into")
    with pytest.raises(ValueError, match=message):
        _run(cfg, listops_cache, tmp_path, resume=True)
    with pytest.raises(ValueError, match=message):
        check_run(cfg, tmp_path, listops_cache, resume=True)
    monkeypatch.undo()
    finished = tmp_path / "finished"
    result = _run(cfg, listops_cache, finished)
    (finished / "best.pt").unlink()
    check_run(cfg, finished, listops_cache, resume=True)
    assert _run(cfg, listops_cache, finished, resume=True) == result


def test_a_run_killed_before_result_json_holds_one_test_entry_after_resume(
        listops_cache, tmp_path, monkeypatch):
    """Killed between its test entry and result.json, the resumed run logs the test entry
    again: metrics.jsonl, test.csv and TensorBoard hold it once, at the final step, with
    the best step it tested; the train and dev entries of that step stay."""
    pytest.importorskip("tensorboard")
    import importlib

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lra_train = importlib.import_module("skyformer.lra.train")
    write_json = lra_train.write_json

    def killed(path, data, **kwargs):
        if path.name == "result.json":
            raise KeyboardInterrupt
        return write_json(path, data, **kwargs)

    cfg = _cfg(steps=6, eval_every=2, log_every=2)
    _scripted_dev(monkeypatch, {2: 0.5, 4: 0.9, 6: 0.6})
    monkeypatch.setattr(lra_train, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, cache_root=listops_cache, out_dir=tmp_path, quiet=True)
    monkeypatch.setattr(lra_train, "write_json", write_json)
    result = train(cfg, cache_root=listops_cache, out_dir=tmp_path, quiet=True, resume=True)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("test/accuracy")] == [6]
    assert [e.value for e in events.Scalars("test/best_step")] == [result["best_step"]] == [4]
    assert [e.step for e in events.Scalars("dev/accuracy")] == [2, 4, 6]
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    tests = [r for r in _history(tmp_path) if r["kind"] == "test"]
    assert [(r["step"], r["best_step"]) for r in tests] == [(6, 4)]
    assert len((tmp_path / "test.csv").read_text().splitlines()) == 2


def test_temporary_files_of_interrupted_writes_are_removed_when_a_run_starts(
        listops_cache, tmp_path):
    """A kill between writing a checkpoint's or result's temporary file and its rename
    left ``.last.pt.XXXXXXXX.tmp`` (a model's size) in the folder for good; a new run or
    a resumed one removes those of its own files, and nothing else."""
    cfg = _cfg(steps=4, eval_every=2)
    leftovers = [".last.pt.k2x_9abc.tmp", ".best.pt.abcdefgh.tmp", ".result.json.12345678.tmp",
                 ".metrics.jsonl.a1b2c3d4.tmp", ".dev.csv.zzzzzzzz.tmp"]
    others = [".notes.abcdefgh.tmp", ".last.pt.short.tmp", "last.pt.abcdefgh.tmp"]
    for folder, kwargs in ((tmp_path / "new", {"stop_after": 2}),
                           (tmp_path / "new", {"resume": True})):
        folder.mkdir(exist_ok=True)
        for name in leftovers + others:
            (folder / name).write_text("partial")
        _run(cfg, listops_cache, folder, **kwargs)
        assert sorted(p.name for p in folder.glob("*.tmp")) == sorted(others)


def test_a_new_run_stopped_at_step_0_resumes_as_an_uninterrupted_run(listops_cache, tmp_path):
    """stop_after=0 said the run stopped, to be continued with --resume, but wrote no
    last.pt: the resume was a new run. Its step-0 checkpoint continues exactly."""
    cfg = _cfg(attention="skyformer", attention_options={"num_features": 4}, steps=6)
    whole = _run(cfg, listops_cache, tmp_path / "whole")
    assert _run(cfg, listops_cache, tmp_path / "cut", stop_after=0) is None
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["state"]["step"] == 0
    resumed = _run(cfg, listops_cache, tmp_path / "cut", resume=True)
    _assert_same_tensors(load_checkpoint(tmp_path / "whole" / "last.pt")["model"],
                         load_checkpoint(tmp_path / "cut" / "last.pt")["model"])
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert _history(tmp_path / "whole") == _history(tmp_path / "cut")


def test_peak_memory_is_that_of_training_steps_not_of_evaluations(
        listops_cache, tmp_path, monkeypatch):
    """Table 2's peak is the training's: the counter is reset after each evaluation (on
    CUDA evaluation at batch_size / processes can exceed a micro-batch of training)."""
    import importlib

    lra_train = importlib.import_module("skyformer.lra.train")
    peak = {"now": 0}
    train_step, evaluate = lra_train.Trainer._train_step, lra_train.evaluate

    def stepping(self):
        train_step(self)
        peak["now"] = max(peak["now"], 100)

    def evaluating(*args, **kwargs):
        peak["now"] = max(peak["now"], 10_000)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(lra_train.Trainer, "_train_step", stepping)
    monkeypatch.setattr(lra_train, "evaluate", evaluating)
    monkeypatch.setattr(lra_train, "reset_peak_memory", lambda device: peak.update(now=0))
    monkeypatch.setattr(lra_train, "peak_memory_bytes", lambda device: peak["now"])
    result = _run(_cfg(steps=8, eval_every=2, log_every=2), listops_cache, tmp_path / "run")
    assert result["peak_memory_bytes"] == 100


def test_a_cpu_peak_is_the_runs_not_that_of_an_earlier_run_of_the_process():
    """``lra train --seeds`` trains its seeds in one process, and the maximum resident
    size only grows: a run reported the peak of a larger run before it. On Linux the
    peak resident size is reset where CUDA's counter is."""
    from skyformer.lra import metrics

    cpu = torch.device("cpu")
    metrics.reset_peak_memory(cpu)
    if not metrics.cpu_peak_resets():  # not Linux, or /proc read-only
        pytest.skip("no writable /proc/self/clear_refs: a CPU peak is the process's")
    big = torch.ones(32 << 20)  # 128 MiB, every page touched
    del big
    earlier = metrics.peak_memory_bytes(cpu)
    metrics.reset_peak_memory(cpu)
    assert metrics.peak_memory_bytes(cpu) < earlier - (64 << 20)


def _metrics_without_resource(monkeypatch):
    """``skyformer.lra.metrics`` imported afresh where the ``resource`` module does not
    exist (Windows)."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "resource", None)  # import resource: ImportError
    monkeypatch.delitem(sys.modules, "skyformer.lra.metrics")
    metrics = importlib.import_module("skyformer.lra.metrics")
    monkeypatch.setattr(sys.modules["skyformer.lra"], "metrics", metrics)
    return metrics


def test_peak_memory_without_the_resource_module(monkeypatch):
    """``resource`` is Unix only: ``skyformer lra train`` stopped on Windows with "No
    module named 'resource'"; the peak there is the process's peak working set."""
    import sys
    import types

    metrics = _metrics_without_resource(monkeypatch)
    monkeypatch.setattr(metrics, "_STATUS", metrics._STATUS.with_name("no_such_file"))
    info = types.SimpleNamespace(peak_wset=3 << 20)  # psutil's Windows memory_info
    process = types.SimpleNamespace(memory_info=lambda: info)
    monkeypatch.setitem(sys.modules, "psutil", types.SimpleNamespace(Process=lambda: process))
    assert metrics.peak_memory_bytes(torch.device("cpu")) == 3 << 20


def test_resume_refuses_data_of_the_same_sizes_but_other_examples(tmp_path):
    """Counts, label counts and mean lengths do not identify prepared data: the same
    training rows in another order (another data order, another run) are refused too."""
    from skyformer.lra import prepare, write_listops
    from tests.lra.release_files import TINY_RULES

    src = tmp_path / "src"
    write_listops(src, train=64, dev=16, test=16, rules=TINY_RULES, seed=0)
    cfg, run, cache = _cfg(steps=4), tmp_path / "run", tmp_path / "cache"
    prepare("listops", src, cache, max_len=8)
    _run(cfg, cache, run, stop_after=2)
    train_file = src / "basic_train.tsv"
    header, *rows = train_file.read_text(encoding="utf-8").splitlines()
    train_file.write_text("\n".join([header, *reversed(rows)]) + "\n", encoding="utf-8")
    prepare("listops", src, cache, max_len=8)
    with pytest.raises(ValueError, match=r"differs from the data the run started with "
                       r"\(meta.json: splits\)"):
        _run(cfg, cache, run, resume=True)


def test_the_report_keeps_runs_on_other_prepared_data_apart(listops_cache, tmp_path):
    """result.json records the splits' sizes and digests: two seeds trained on data of
    other sizes are two rows of the report, not one experiment's two seeds."""
    from skyformer.lra import prepare, write_listops
    from skyformer.lra.report import collect_runs, tables
    from tests.lra.release_files import TINY_RULES

    write_listops(tmp_path / "src", train=64, dev=64, test=64, rules=TINY_RULES, seed=0)
    prepare("listops", tmp_path / "src", tmp_path / "cache", max_len=8)
    cfg = _cfg(steps=2, eval_every=2, log_every=2)
    _run(cfg, listops_cache, tmp_path / "runs" / "seed0")
    _run(dataclasses.replace(cfg, seed=1), tmp_path / "cache", tmp_path / "runs" / "seed1")
    result = json.loads((tmp_path / "runs" / "seed1" / "result.json").read_text())
    assert result["data"]["splits"]["train"]["count"] == 64
    rows = [line for line in tables(collect_runs([tmp_path / "runs"])).split("Table 2")[0]
            .splitlines() if line.startswith("| softmax")]
    assert len(rows) == 2 and all("(1)" in row for row in rows), rows
    assert "data.splits.train.count=64" in rows[1] or "data.splits.train.count=64" in rows[0]


# Skyformer section 5 (Implementation Details): batch size and learning rate per task,
# 50k steps, a 2-layer transformer of width 64, MLP hidden 128 and 2 heads.
PAPER_SETTINGS = {"text": (16, 1e-4), "listops": (32, 1e-4), "retrieval": (16, 2e-4),
                  "pathfinder": (128, 2e-4), "image": (256, 1e-4)}


@pytest.mark.parametrize("task", sorted(PAPER_SETTINGS))
def test_each_task_preset_is_the_papers_setting(task):
    cfg = make_config(task)
    assert (cfg.batch_size, cfg.lr) == PAPER_SETTINGS[task]
    assert (cfg.steps, cfg.dim, cfg.hidden, cfg.heads, cfg.layers) == (50_000, 64, 128, 2, 2)
    assert cfg.dim // cfg.heads == 32  # head dim
    assert cfg.patience is None  # every model trains for the full 50k steps


def test_a_run_recorded_before_split_digests_resumes_on_the_same_data_prepared_again(
        tmp_path):
    """A checkpoint whose data record has no split digests (written before meta.json held
    them) was refused on the same files prepared again, whose record has them, and told
    to prepare them again, which adds them again: the run could not be resumed at all.
    It is compared on what it recorded; other examples of those sizes cannot be told
    apart there."""
    from skyformer.lra import prepare, write_listops
    from tests.lra.release_files import TINY_RULES

    src = tmp_path / "src"
    write_listops(src, train=64, dev=16, test=16, rules=TINY_RULES, seed=0)
    cfg, run, cache = _cfg(steps=3), tmp_path / "run", tmp_path / "cache"
    prepare("listops", src, cache, max_len=8)
    _run(cfg, cache, run, stop_after=2)
    ckpt = torch.load(run / "last.pt", weights_only=False)
    for split in ckpt["data"]["splits"].values():
        del split["sha256"]
    torch.save(ckpt, run / "last.pt")
    prepare("listops", src, cache, max_len=8)
    assert _run(cfg, cache, run, resume=True)["steps"] == 3
