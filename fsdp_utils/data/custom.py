"""`--dataset_module FILE.py:FUNCTION`: your own code returns the rows (llama-recipes'
`custom_dataset`).

The function takes no arguments and returns rows in any format the trainer reads (chat
`messages`, `prompt`/`completion`, alpaca, `text`, or columns for --prompt_template): a
`datasets.Dataset`, or a list (or any iterable) of dicts. It runs where the data is prepared:
on rank 0 of the training job, or on the login node with `download_models.py --prepare`. It
must work offline there, and give the same rows every time: the prepared cache is keyed by
the rows it returns (a digest of their content), so changed rows are prepared again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModuleRows:
    dataset: Any  # datasets.Dataset
    spec: str  # FILE.py:FUNCTION as given
    digest: str  # sha256 of the rows' content (Arrow IPC bytes)


def import_function(spec: str, *, flag: str) -> Callable[..., Any]:
    """FUNCTION of FILE.py in `spec` ("FILE.py:FUNCTION"), the file imported as a module of its
    own, again on every call (its folder on sys.path while it loads, so that it can import its
    neighbours). A missing file or function, or a file that fails to import, is a ValueError
    naming `flag` (--dataset_module, --reward_funcs) and, for a function, those the file has."""
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser()
    if not path.is_file():
        raise ValueError(f"{flag} {spec}: {path} is not a file (expected FILE.py:FUNCTION).")
    module_name = (
        f"fsdp_utils_user_module_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
    )
    loader = importlib.util.spec_from_file_location(module_name, path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        loader.loader.exec_module(module)
    except Exception as err:  # the user's code: one paragraph, where and what
        raise ValueError(
            f"{flag} {spec}: importing {path} failed: {type(err).__name__}: {err}"
        ) from err
    finally:
        sys.path.remove(str(path.resolve().parent))
    function = getattr(module, name, None)
    if not callable(function):
        found = [
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
        ]
        raise ValueError(
            f"{flag} {spec}: {path} has no function {name!r} (its functions: "
            f"{', '.join(found) or 'none'})."
        )
    return function


def load_dataset_module(spec: str) -> ModuleRows:
    """Import FILE.py, call FUNCTION(), and return its rows as a `datasets.Dataset`."""
    import datasets

    function = import_function(spec, flag="--dataset_module")
    rows = function()
    if isinstance(rows, datasets.DatasetDict):
        raise ValueError(
            f"--dataset_module {spec} returned a DatasetDict ({', '.join(rows)}): return one "
            "split, e.g. dataset['train']; the trainer holds out --eval_examples rows itself."
        )
    if not isinstance(rows, datasets.Dataset):
        try:
            rows = datasets.Dataset.from_list([dict(r) for r in rows])
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"--dataset_module {spec} must return a datasets.Dataset or a list of dicts "
                f"(rows), got {type(rows).__name__}: {err}"
            ) from None
    if len(rows) == 0:
        raise ValueError(f"--dataset_module {spec} returned no rows.")
    return ModuleRows(rows.flatten_indices(), spec, content_digest(rows))


def content_digest(dataset: Any) -> str:
    """sha256 of the dataset's rows as Arrow IPC bytes, streamed (no second copy in memory)."""
    import pyarrow as pa

    digest = hashlib.sha256()

    class _Sink:
        closed = False

        def write(self, data: Any) -> int:
            view = memoryview(data)
            digest.update(view)
            return view.nbytes

        def flush(self) -> None:
            pass

    table = dataset.flatten_indices().data.table
    with pa.ipc.new_stream(pa.PythonFile(_Sink(), mode="w"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1 << 16):
            writer.write_batch(batch)
    return digest.hexdigest()
