"""Result files and the folders that hold them.

- ``atomic``: writes through a temporary file and a rename, so a crash never leaves a
  half-written file (``atomic_writer``, ``atomic_write_text``, ``save_figure``), and
  what a killed write left (``remove_interrupted_writes``).
- ``result_files``: strict JSON (a non-finite number is ``null``) and CSV results
  (``write_json``, ``write_csv``), read back to resume (``read_to_resume``).
- ``output_paths``: checks of an output path before any work (``check_output_path``,
  ``refuse_overwriting_inputs``).
- ``locks``: one run at a time in a folder (``folder_lock``, ``results_lock``: a lock
  file naming its process, taken over from a dead one; ``processes`` tells).
- ``folders``: a folder built aside and renamed into place (``building_folder``), files
  replaced together (``replacing_together``), and what a killed build left
  (``remove_dead_builds``).
- ``environment``: what a result depends on besides its config.
"""

from .atomic import (
    DIR_MODE,
    FILE_MODE,
    FULL_DISK,
    atomic_write_text,
    atomic_writer,
    remove_interrupted_writes,
    remove_stale,
    save_figure,
)
from .environment import environment
from .folders import building_folder, remove_dead_builds, replacing_together
from .locks import EMPTY_LOCK_SECONDS, LOCK_FILE, folder_lock, results_lock
from .output_paths import (
    check_output_path,
    portable_name,
    refuse_overwriting_inputs,
    refuse_special_file,
)
from .result_files import json_ready, json_text, read_to_resume, write_csv, write_json

__all__ = [
    "DIR_MODE",
    "EMPTY_LOCK_SECONDS",
    "FILE_MODE",
    "FULL_DISK",
    "LOCK_FILE",
    "atomic_write_text",
    "atomic_writer",
    "building_folder",
    "check_output_path",
    "environment",
    "folder_lock",
    "json_ready",
    "json_text",
    "portable_name",
    "read_to_resume",
    "refuse_overwriting_inputs",
    "refuse_special_file",
    "remove_dead_builds",
    "remove_interrupted_writes",
    "remove_stale",
    "replacing_together",
    "results_lock",
    "save_figure",
    "write_csv",
    "write_json",
]
