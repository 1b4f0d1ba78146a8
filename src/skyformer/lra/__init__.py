"""Long Range Arena: data readers and cache, generators, the papers' model, training,
reports and the instability score (``skyformer lra ...``)."""

from __future__ import annotations

from .cache import TaskData, default_cache_root, load_cache
from .listops_gen import ListOpsRules, write_listops
from .model import LRAClassifier, ModelConfig
from .pathfinder_gen import PathfinderRules, write_pathfinder
from .prepare import prepare
from .presets import PRESETS, TrainConfig, make_config
from .tasks import TASKS, get_task
from .train import train

__all__ = [
    "PRESETS",
    "TASKS",
    "LRAClassifier",
    "ListOpsRules",
    "ModelConfig",
    "PathfinderRules",
    "TaskData",
    "TrainConfig",
    "default_cache_root",
    "get_task",
    "load_cache",
    "make_config",
    "prepare",
    "train",
    "write_listops",
    "write_pathfinder",
]
