"""The login node's half: `download_models.py --eval_tasks arc_easy,mmlu,...`.

For each requested task or group: its leaf tasks from lm-eval's YAMLs (`tasks.leaves_of`: the
index of the task folders that declare the names, not all ~15,000 files); per dataset
repository, the README (its `configs:` say which files each config reads) and then
exactly those files, fetched by the toolkit's downloader (pinned to a commit, checksummed, in
the manifest); then every leaf task is built from the cache, offline, as the compute node will
build it, so that a dataset that needs a loading script or anything else from the network is
named here, with the reason, and never recorded. NLTK data that a task loads at import time
(IFEval's `punkt_tab`) goes to `<hub cache>/nltk_data`, which the evaluation points NLTK at.

`python -m fsdp_utils.lm_harness.task_cache --cache-dir DIR` builds every recorded task offline
(`download_models.py --check-offline` runs it with no network).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_utils.arguments import ArgumentParser
from fsdp_utils.hub.manifest import find_entry, load_manifest
from fsdp_utils.hub.specs import AssetSpec
from fsdp_utils.lm_harness.tasks import (
    LeafTask,
    cached_leaves,
    leaves_of,
    load_task_records,
    quiet_task_logs,
    save_task_records,
    snapshot_of,
    task_manager,
    write_overrides,
)

Log = Callable[[str], None]
README = "README.md"
DATA_GLOBS = ("*.parquet", "*.jsonl", "*.json", "*.csv", "*.arrow")
# Tasks (by the folder of their YAML under lm_eval/tasks) that load NLTK data when imported.
NLTK_PACKAGES = {"ifeval": ("punkt_tab",), "leaderboard/ifeval": ("punkt_tab",)}
NLTK_FOLDER = "nltk_data"


class TaskDataError(ValueError):
    """A task whose data cannot be cached for offline use; the message says why."""


def nltk_folder(cache: Path) -> Path:
    return cache / NLTK_FOLDER


def use_cached_nltk(cache: Path) -> None:
    """Point NLTK at the cache's data (before lm-eval imports a task that loads it)."""
    folder = nltk_folder(cache)
    if folder.is_dir():
        paths = [str(folder), *filter(None, os.environ.get("NLTK_DATA", "").split(os.pathsep))]
        os.environ["NLTK_DATA"] = os.pathsep.join(dict.fromkeys(paths))


def nltk_packages(leaves: list[LeafTask]) -> list[str]:
    wanted: dict[str, None] = {}
    for leaf in leaves:
        for prefix, packages in NLTK_PACKAGES.items():
            if leaf.yaml.startswith(prefix + "/"):
                wanted.update(dict.fromkeys(packages))
    return list(wanted)


def config_files(readme: str, config: str | None) -> list[str] | None:
    """The data-file globs `config` reads, from a dataset card's `configs:`; None when the card
    declares no configs (datasets then infers them from the folder layout)."""
    import yaml

    if not readme.startswith("---"):
        return None
    header = readme.split("---", 2)[1]
    configs = (yaml.safe_load(header) or {}).get("configs")
    if not configs:
        return None
    by_name = {c.get("config_name", "default"): c for c in configs}
    chosen = by_name.get(config or "default")
    if chosen is None and config is None:
        defaults = [c for c in configs if c.get("default")] or configs[:1]
        chosen = defaults[0]
    if chosen is None:
        raise TaskDataError(f"its card declares no config {config!r} (it has {sorted(by_name)})")
    data_files = chosen.get("data_files") or []
    if isinstance(data_files, str):
        return [data_files]
    globs: list[str] = []
    for item in data_files:
        path = item.get("path") if isinstance(item, dict) else item
        globs += [path] if isinstance(path, str) else list(path or [])
    return globs


def _include(globs: list[str] | None, existing: list[str]) -> str:
    """The download include for a dataset: its card, the config's globs (or every data file),
    and what an earlier download of the same repo already holds."""
    import glob as globmod

    patterns = [README, *(globs if globs is not None else DATA_GLOBS)]
    patterns += [globmod.escape(p) for p in existing]
    return ",".join(dict.fromkeys(patterns))


def download_task_data(
    names: list[str], cache: Path, *, workers: int = 8, log: Log = print
) -> dict[str, list[LeafTask]]:
    """Cache what `names` read; record them. TaskDataError names the tasks that cannot be
    cached (nothing is recorded for them; the others are)."""
    from fsdp_utils.hub.download import download_assets

    requested, problems = leaves_of(names)
    repos: dict[str, list[LeafTask]] = {}
    for leaves in requested.values():
        for leaf in leaves:
            repos.setdefault(leaf.dataset, []).append(leaf)
    commits: dict[str, str] = {}
    for repo, leaves in repos.items():
        try:
            commits[repo] = _download_repo(repo, leaves, cache, workers, log, download_assets)
        except Exception as err:  # every dataset is tried; each failure is named
            tasks = ", ".join(sorted({leaf.task for leaf in leaves}))
            why = str(err) if isinstance(err, ValueError) else _first_line(err)
            problems.append(f"dataset {repo} (task(s) {tasks}): {why}")
    done: dict[str, list[LeafTask]] = {}
    for name, leaves in requested.items():
        if all(leaf.dataset in commits for leaf in leaves):
            done[name] = [replace(leaf, commit=commits[leaf.dataset]) for leaf in leaves]
    for name, leaves in list(done.items()):
        try:
            for package in nltk_packages(leaves):
                _download_nltk(package, cache, log)
        except TaskDataError as err:
            problems.append(f"{name}: {err}")
            done.pop(name)
    for name, why in check_tasks(done, cache, log=log).items():
        problems.append(f"{name}: {why}")
        done.pop(name)
    save_task_records(cache, done)
    if done:
        log(f"lm-eval tasks cached: {', '.join(done)}")
    if problems:
        raise TaskDataError(
            "These tasks cannot be evaluated offline, so nothing was recorded for them:\n  "
            + "\n  ".join(problems)
        )
    return done


def _download_repo(
    repo: str, leaves: list[LeafTask], cache: Path, workers: int, log: Log, download: Any
) -> str:
    """The card first (its configs say which files each config reads; read at the commit
    the branch points to now, outside the cache), then those files at that commit."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    commit = str(api.repo_info(repo, repo_type="dataset", revision="main").sha)
    repo_files = api.list_repo_files(repo, repo_type="dataset", revision=commit)
    readme = ""
    if README in repo_files:
        with tempfile.TemporaryDirectory() as tmp:
            path = hf_hub_download(
                repo, README, repo_type="dataset", revision=commit, cache_dir=tmp
            )
            readme = Path(path).read_text()
    globs: list[str] | None = []
    for config in sorted({leaf.config or "" for leaf in leaves}):
        found = config_files(readme, config or None)
        if found is None:
            globs = None
            break
        assert globs is not None
        globs += found
    scripts = [p for p in repo_files if p.endswith(".py") and "/" not in p]
    if globs is None and scripts and not any(p.endswith(DATA_GLOBS) for p in repo_files):
        raise TaskDataError(
            f"it is loaded by a script ({', '.join(scripts)}), which the datasets library no "
            "longer runs and which would need the network; it has no data files to read instead"
        )
    previous = find_entry(load_manifest(cache), "dataset", repo, commit)
    existing = sorted(previous.file_paths()) if previous else []
    spec = AssetSpec(repo, "dataset", commit, _include(globs, existing))
    (entry,) = download([spec], cache, workers=workers, log=log)
    return str(entry.commit)


def _download_nltk(package: str, cache: Path, log: Log) -> None:
    import nltk

    folder = nltk_folder(cache)
    try:
        nltk.data.find(f"tokenizers/{package}", paths=[str(folder)])
        return
    except LookupError:
        pass
    log(f"NLTK data {package} -> {folder}")
    try:
        fetched = nltk.download(package, download_dir=str(folder), quiet=True, raise_on_error=True)
    except Exception:  # nltk raises whatever its HTTP client raised
        fetched = False
    if not fetched:
        raise TaskDataError(
            f"NLTK could not download {package!r} into {folder} (IFEval needs it): fetch it "
            f"on a machine with internet (python -m nltk.downloader -d {folder} {package}) "
            "and copy the folder there."
        )


def check_tasks(
    records: dict[str, list[LeafTask]], cache: Path, *, log: Log = print
) -> dict[str, str]:
    """Build every leaf task from the cache, offline, as the evaluation does. Returns
    {name: why} for those that fail."""
    use_cached_nltk(cache)
    quiet_task_logs()
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fsdp-utils-lm-eval-check-") as tmp:
        for name, leaves in records.items():
            folder = Path(tmp) / name
            try:
                snapshots = {leaf.task: snapshot_of(leaf, cache) for leaf in leaves}
            except ValueError as err:  # its own paragraph, ending with the command to run
                failed[name] = str(err)
                log(f"FAIL lm-eval {name}: {err}")
                continue
            try:
                write_overrides(snapshots, folder, {leaf.task: leaf.yaml for leaf in leaves})
                loaded = task_manager([name], leaves, folder).load([name])
                docs = sum(_count_docs(task) for task in loaded["tasks"].values())
                log(f"OK   lm-eval {name}: {len(loaded['tasks'])} task(s), {docs} documents")
            except Exception as err:  # report every task, with what went wrong
                failed[name] = _first_line(err)
                log(f"FAIL lm-eval {name}: {failed[name]}")
    return failed


def _first_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}"


def _count_docs(task: Any) -> int:
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    return len(docs) if docs is not None else 0


def run_offline_task_check(cache: Path, log: Log = print) -> int:
    """`check_tasks` on every recorded task in a child process with no network (as
    --check-offline runs the assets' check). 0 when every task builds, or none is recorded."""
    from fsdp_utils.hub.offline_check import run_isolated

    if not load_task_records(cache):
        return 0
    module, args = "fsdp_utils.lm_harness.task_cache", ["--cache-dir", str(cache)]
    return run_isolated(module, args, what="offline check of the lm-eval tasks", log=log)


def main(argv: list[str] | None = None) -> int:
    """The offline check of the recorded tasks (a child process with no network)."""
    from fsdp_utils.hub.offline import enable_offline_mode

    enable_offline_mode(force=True)
    parser = ArgumentParser(description="Build every cached lm-eval task offline.")
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args(argv)
    cache = Path(args.cache_dir)
    records = load_task_records(cache)
    if not records:
        print(f"lm-eval: no tasks recorded in {cache}")
        return 0
    try:
        cached_leaves(list(records), cache)
    except ValueError as err:
        print(f"FAIL lm-eval: {err}")
        return 1
    failed = check_tasks(records, cache)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
