"""lm-eval's tasks reading their datasets from the offline cache, their YAMLs unchanged.

A task's YAML names a Hub dataset (`dataset_path: allenai/ai2_arc`, `dataset_name: ARC-Easy`),
which `datasets.load_dataset` would fetch. `download_models.py --eval_tasks` downloads that
repository into the hub cache like every other asset (pinned to a commit, verified, in
`offline-manifest.json`) and records, per requested task or group, its leaf tasks with their
YAML and dataset commit in `<hub cache>/lm-eval-tasks.json`. On the compute node each leaf task
gets a two-line YAML of its own in a private `--include_path` folder:

    include: <lm_eval>/tasks/arc/arc_easy.yaml     # the task itself, unchanged
    dataset_path: <hub cache>/datasets--allenai--ai2_arc/snapshots/<commit>

lm-eval lets a task found later on its include path replace one of the same name, so the task
keeps its prompts, metrics, filters and version; only where its files come from changes
(`datasets` reads the local snapshot with the same README configs and parquet files the Hub
serves).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import closest
from fsdp_utils.hub.manifest import find_entry, load_manifest

TASKS_FILE = "lm-eval-tasks.json"


@dataclass(frozen=True)
class LeafTask:
    """One task that reads a dataset (a group's members are leaves too)."""

    task: str
    yaml: str  # its YAML, relative to lm_eval/tasks
    dataset: str  # the Hub repository id (dataset_path)
    config: str | None  # dataset_name
    commit: str | None = None  # the cached snapshot's commit (set by the download)


def quiet_task_logs() -> None:
    """lm-eval warns at length that the task files written here replace its own (that is the
    point) and that wikitext's metrics take default aggregations (as they always do)."""
    import logging

    for name in ("lm_eval.tasks", "lm_eval.api.task"):
        logging.getLogger(name).setLevel(logging.ERROR)


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def leaf_tasks(name: str, task_manager: Any) -> list[LeafTask]:
    """The tasks `name` (a task, group or tag) runs, read from lm-eval's YAMLs without
    building them (building loads the datasets). ValueError for an unknown name or a task that
    names no Hub dataset in its YAML (a Python task: it loads its own data)."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    index = task_manager.task_index
    root = lm_eval_tasks_dir()
    leaves: dict[str, LeafTask] = {}

    def visit(item: Any, overrides: dict[str, Any], seen: tuple[str, ...]) -> None:
        if isinstance(item, dict):
            key = "group" if "group" in item else "task"
            extra = {k: v for k, v in item.items() if k != key}
            visit(item[key], {**overrides, **extra}, seen)
            return
        entry = index.get(item)
        if entry is None or item in seen:
            raise ValueError(no_such_task([item], index))
        if entry.kind == Kind.TAG:
            for other in sorted(n for n, e in index.items() if item in (e.tags or set())):
                visit(other, overrides, (*seen, item))
            return
        if entry.yaml_path is None:
            raise ValueError(f"lm-eval task {item!r} has no YAML file to read its dataset from.")
        config = load_yaml(entry.yaml_path, resolve_func=False)
        if entry.kind == Kind.GROUP:
            members = config.get("task") or []
            group_overrides = {k: v for k, v in config.items() if k in ("dataset_path",)}
            for member in members if isinstance(members, list) else [members]:
                visit(member, {**group_overrides, **overrides}, (*seen, item))
            return
        config = {**config, **overrides}
        if entry.kind == Kind.PY_TASK or not config.get("dataset_path"):
            raise ValueError(
                f"lm-eval task {item!r} is a Python task that loads its own data: it cannot be "
                "cached for the compute nodes by this toolkit."
            )
        yaml = str(Path(entry.yaml_path).resolve().relative_to(root.resolve()))
        leaves[item] = LeafTask(item, yaml, config["dataset_path"], config.get("dataset_name"))

    visit(name, {}, ())
    return list(leaves.values())


def _version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


# A task file's name, group and tags: `task: arc_easy`, `"task": "..."`, `tag: [a, b]`, or a
# `tag:` followed by `- name` lines.
_NAME_KEY = re.compile(r"""^["']?(task|group|tag)["']?:[ \t]*(.*)$""")
_LIST_ITEM = re.compile(r"^[ \t]*-[ \t]*([^\s#]+)")


def known_task_names() -> set[str]:
    """Every task, group and tag name lm-eval's own task files declare, read as text: ~1 s,
    where lm-eval's index (`TaskManager()`) parses all ~15,000 YAMLs (20 s of CPU and more). On
    lm-eval 0.4.13 it holds every name of that index (and four names no task registers), so
    a name it lacks is no task of lm-eval's; a name it has may still not be one, which the
    login node's `download_models.py --eval_tasks` then says from the index itself. Templates
    without a .yaml suffix (`_default_template_yaml`, extensionless includes) count: tags come
    from them."""
    return set(_declared_names())


@functools.cache
def _declared_names() -> dict[str, frozenset[Path]]:
    """{name: the task files that declare it}, a file counting as declaring what the files
    it includes declare (a task file takes its tag from its folder's template)."""
    own: dict[Path, set[str]] = {}
    includes: dict[Path, list[Path]] = {}
    for path in lm_eval_tasks_dir().rglob("*"):
        if not (path.name.endswith("yaml") or path.suffix == "") or not path.is_file():
            continue
        names = own[path] = set()
        lines = path.read_text(errors="replace").splitlines()
        for at, line in enumerate(lines):
            if line.startswith("include:"):
                target = line.partition(":")[2].split("#")[0].strip().strip("'\"")
                includes.setdefault(path, []).append(Path(os.path.normpath(path.parent / target)))
            found = _NAME_KEY.match(line)
            if found is None:
                continue
            value = found.group(2).split("#")[0].strip().strip("'\"")
            if value.startswith("["):  # tag: [a, b]
                names.update(v.strip().strip("'\"") for v in value.strip("[]").split(","))
            elif value and not value.startswith(("!", "{")):
                names.add(value)
            elif not value and found.group(1) == "tag":
                for item in lines[at + 1 :]:
                    listed = _LIST_ITEM.match(item)
                    if listed is None:
                        break
                    names.add(listed.group(1).strip("'\""))
    declared: dict[str, set[Path]] = {}
    for path in own:
        names, todo, seen = set(own[path]), list(includes.get(path, [])), {path}
        while todo:
            included = todo.pop()
            if included in seen or included not in own:
                continue
            seen.add(included)
            names |= own[included]
            todo += includes.get(included, [])
        for name in names - {""}:
            declared.setdefault(name, set()).add(path)
    return {name: frozenset(paths) for name, paths in declared.items()}


def task_index(names: list[str]) -> Any | None:
    """lm-eval's TaskManager over the task folders (`tasks/arc`, `tasks/mmlu`, ...) whose files
    declare `names` (`_declared_names`): what `leaf_tasks` reads, in a second where the whole
    index takes 15-20 s of CPU. None when only the whole index can answer: a name declared
    outside a family's folder, or nowhere (a typo: the whole index names the closest)."""
    from lm_eval.tasks import TaskManager

    root = lm_eval_tasks_dir()
    declared = _declared_names()
    folders: set[str] = set()
    for name in names:
        paths = declared.get(name)
        if not paths:
            return None
        for path in paths:
            parts = path.relative_to(root).parts
            if len(parts) < 2:
                return None
            folders.add(str(root / parts[0]))
    return TaskManager(include_path=sorted(folders), include_defaults=False)


def leaves_of(names: list[str]) -> tuple[dict[str, list[LeafTask]], list[str]]:
    """Each name's leaf tasks, read from `task_index(names)`, or from lm-eval's whole index
    where that one cannot answer or a name does not expand in it (a group whose member lies
    in another folder, a name that is no task: the whole index says so, with its closest
    names). Returns ({name: leaves}, the problems: "name: why")."""
    from lm_eval.tasks import TaskManager

    narrow = task_index(names)
    if narrow is not None:
        leaves, problems = _expand(names, narrow)
        if not problems:
            return leaves, problems
    return _expand(names, TaskManager())


def _expand(names: list[str], index: Any) -> tuple[dict[str, list[LeafTask]], list[str]]:
    leaves: dict[str, list[LeafTask]] = {}
    problems: list[str] = []
    for name in names:
        try:
            leaves[name] = leaf_tasks(name, index)
        except ValueError as err:
            problems.append(f"{name}: {err}")
    return leaves, problems


def require_known_tasks(names: list[str]) -> None:
    """ValueError naming the names lm-eval has no task of (`known_task_names`: offline, on
    the login node and the compute node alike), with the closest ones it has."""
    known = known_task_names()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(no_such_task(unknown, known))


def no_such_task(names: list[str], known: Iterable[str]) -> str:
    """One paragraph: lm-eval has no task of these names; the closest ones it has."""
    known = list(known)
    shown = []
    for name in names:
        close = closest(name, known, n=3)
        shown.append(f"{name!r}" + (f" (closest: {', '.join(close)})" if close else ""))
    return (
        f"lm-eval {_version()} has no task, group or tag named {'; '.join(shown)}. Check the "
        "name (`lm-eval ls tasks` lists them all), or give your own task's folder with "
        "--include_path DIR."
    )


# --- the record the download writes ---------------------------------------------------------


def tasks_file(cache: Path) -> Path:
    return cache / TASKS_FILE


def load_task_records(cache: Path) -> dict[str, list[LeafTask]]:
    """Requested name -> its leaf tasks, as cached ({} when nothing was)."""
    path = tasks_file(cache)
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {
        name: [LeafTask(**leaf) for leaf in leaves]
        for name, leaves in record.get("tasks", {}).items()
    }


def save_task_records(cache: Path, records: dict[str, list[LeafTask]]) -> None:
    """Merge `records` into the cache's record (atomically: a reader never sees half)."""
    current = load_task_records(cache)
    current.update(records)
    document = {
        "lm_eval_version": _version(),
        "tasks": {name: [asdict(leaf) for leaf in leaves] for name, leaves in current.items()},
    }
    path = tasks_file(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


# --- the compute side ---------------------------------------------------------------------------


def download_hint(names: list[str]) -> str:
    return f"python download_models.py --eval_tasks {','.join(names)}"


def cached_leaves(names: list[str], cache: Path) -> dict[str, list[LeafTask]]:
    """The cached leaf tasks of every requested name; ValueError naming the download command
    for the names the cache does not hold."""
    records = load_task_records(cache)
    missing = [n for n in names if n not in records]
    if missing:
        require_known_tasks(missing)  # a typo is no task to download
        raise ValueError(
            f"The offline cache {cache} holds no datasets for the task(s) "
            f"{', '.join(missing)}. On the login node run:\n  {download_hint(missing)}"
        )
    return {name: records[name] for name in names}


def snapshot_of(leaf: LeafTask, cache: Path) -> Path:
    entry = find_entry(load_manifest(cache), "dataset", leaf.dataset, leaf.commit)
    if entry is None or not entry.snapshot(cache).is_dir():
        raise ValueError(
            f"Dataset {leaf.dataset} of task {leaf.task} (commit {leaf.commit}) is not in the "
            f"offline cache {cache}. On the login node run:\n  {download_hint([leaf.task])}"
        )
    return entry.snapshot(cache)


def write_overrides(leaves: dict[str, Path], folder: Path, yamls: dict[str, str]) -> None:
    """One YAML per leaf task in `folder`: the task's own YAML, reading `leaves[task]`."""
    folder.mkdir(parents=True, exist_ok=True)
    root = lm_eval_tasks_dir()
    for task, data in leaves.items():
        text = (
            "# Written by fsdp_utils.evaluate: the task as lm-eval ships it, reading its\n"
            "# dataset from the offline cache.\n"
            f"include: {json.dumps(str(root / yamls[task]))}\n"
            f"task: {json.dumps(task)}\n"
            f"dataset_path: {json.dumps(str(data))}\n"
        )
        (folder / f"{task}.yaml").write_text(text)


def task_manager(
    names: list[str], leaves: list[LeafTask], folder: Path, extra: list[str] | None = None
) -> Any:
    """lm-eval's TaskManager over the task folders the leaves come from, then the override
    folder (and the user's --include_path). Indexing all of lm-eval's ~15,000 YAMLs costs
    seconds to tens of seconds; a task family's own folder (tasks/mmlu for every MMLU subject
    and group) is enough, unless a name lies elsewhere: then everything is indexed."""
    from lm_eval.tasks import TaskManager

    root = lm_eval_tasks_dir()
    families = sorted({str(root / Path(leaf.yaml).parts[0]) for leaf in leaves})
    paths = [*families, str(folder), *(extra or [])]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if all(name in manager.all_tasks for name in names):
        return manager
    return TaskManager(include_path=[str(folder), *(extra or [])])


def offline_tasks(names: list[str], cache: Path, folder: Path) -> list[LeafTask]:
    """Write the include folder for `names` from the cache; returns their leaf tasks."""
    leaves = [leaf for found in cached_leaves(names, cache).values() for leaf in found]
    write_overrides(
        {leaf.task: snapshot_of(leaf, cache) for leaf in leaves},
        folder,
        {leaf.task: leaf.yaml for leaf in leaves},
    )
    return leaves


def provenance(leaves: list[LeafTask]) -> dict[str, dict[str, Any]]:
    """Per leaf task, the dataset it read: for the results file."""
    return {
        leaf.task: {"dataset": leaf.dataset, "config": leaf.config, "commit": leaf.commit}
        for leaf in leaves
    }
