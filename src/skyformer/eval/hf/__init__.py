"""``skyformer hf-eval``: every method as the attention of the pretrained MiniLM-L6 model
(``run``, ``report``), and the short distillation fine-tune (``finetune``, which needs
transformers at import)."""

from .report import format_table
from .run import HFEvalConfig, HFEvalResult, evaluate

__all__ = ["HFEvalConfig", "HFEvalResult", "evaluate", "format_table"]
