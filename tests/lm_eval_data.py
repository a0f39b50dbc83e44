"""Small copies of benchmark datasets, in the layout their Hub repositories publish.

Each repo is a README.md whose YAML header declares its configs and splits (as the Hub's
parquet repos do) and one parquet file per split, with the real column names and types, so
lm-eval's own task YAMLs (arc_easy, hellaswag, gsm8k, mmlu_<subject>, wikitext) load them
unchanged. Text is random pseudo-words (`fsdp_utils.synthetic.random_words`): what matters
here is that the tiny model's scores through this toolkit equal lm-eval's own.

    allenai/ai2_arc                        ARC-Easy/{train,validation,test}-00000-of-00001.parquet
    Rowan/hellaswag                        data/{train,validation,test}-00000-of-00001.parquet
    openai/gsm8k                           main/{train,test}-00000-of-00001.parquet
    cais/mmlu                              abstract_algebra/{dev,validation,test}-...parquet
    EleutherAI/wikitext_document_level     wikitext-2-raw-v1/{train,validation,test}-...parquet
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

from fsdp_utils.synthetic import random_words

# task -> (repo id, config): what each task of the tests reads.
TASK_DATASETS = {
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
    "hellaswag": ("Rowan/hellaswag", None),
    "gsm8k": ("openai/gsm8k", "main"),
    "mmlu_abstract_algebra": ("cais/mmlu", "abstract_algebra"),
    "wikitext": ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1"),
}
# task -> its YAML under lm_eval/tasks (what `tasks.leaf_tasks` reads from lm-eval's index).
TASK_YAMLS = {
    "arc_easy": "arc/arc_easy.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "gsm8k": "gsm8k/gsm8k.yaml",
    "mmlu_abstract_algebra": "mmlu/default/mmlu_abstract_algebra.yaml",
    "wikitext": "wikitext/wikitext.yaml",
}


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def _readme(configs: dict[str, tuple[str, list[str]]]) -> bytes:
    """configs: name -> (folder, splits)."""
    lines = ["---", "configs:"]
    for name, (folder, splits) in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        for split in splits:
            lines += [f"  - split: {split}", f"    path: {folder}/{split}-*"]
    return ("\n".join([*lines, "---", "# small test copy", ""])).encode()


def _files(folder: str, splits: dict[str, list[dict[str, Any]]]) -> dict[str, bytes]:
    return {f"{folder}/{s}-00000-of-00001.parquet": _parquet(rows) for s, rows in splits.items()}


def _arc(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        labels = ["A", "B", "C", "D"] if i % 3 else ["1", "2", "3", "4"]
        texts = [random_words(rng, rng.randint(1, 4)) for _ in labels]
        rows.append(
            {
                "id": f"Mercury_{i:05d}",
                "question": random_words(rng, rng.randint(5, 12)) + "?",
                "choices": {"text": texts, "label": labels},
                "answerKey": labels[rng.randrange(4)],
            }
        )
    return rows


def _hellaswag(rng: random.Random, n: int, split: str) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        ctx_a = random_words(rng, rng.randint(4, 10)) + "."
        ctx_b = random_words(rng, rng.randint(1, 4))
        rows.append(
            {
                "ind": i,
                "activity_label": random_words(rng, 2),
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": f"{ctx_a} {ctx_b}",
                "endings": [random_words(rng, rng.randint(3, 8)) + " [title] x." for _ in range(4)],
                "source_id": f"activitynet~v_{i}",
                "split": split,
                "split_type": "indomain",
                "label": str(rng.randrange(4)) if split != "test" else "",
            }
        )
    return rows


def _gsm8k(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        rows.append(
            {
                "question": f"{random_words(rng, rng.randint(6, 14))} {a} and {b}?",
                "answer": f"{random_words(rng, 5)} {a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n"
                f"#### {a + b}",
            }
        )
    return rows


def _mmlu(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [
        {
            "question": random_words(rng, rng.randint(5, 12)) + "?",
            "subject": "abstract_algebra",
            "choices": [random_words(rng, rng.randint(1, 3)) for _ in range(4)],
            "answer": rng.randrange(4),
        }
        for _ in range(n)
    ]


def _wikitext(rng: random.Random, n: int) -> list[dict[str, Any]]:
    pages = []
    for _ in range(n):
        title = random_words(rng, 2)
        body = " . ".join(random_words(rng, rng.randint(8, 20)) for _ in range(rng.randint(4, 14)))
        pages.append({"page": f" = {title} = \n\n {body} @,@ 3 . \n"})
    return pages


def build_task_repos(seed: int = 0, scale: int = 1) -> dict[str, dict[str, bytes]]:
    """repo id -> {path in the repo: bytes}: every repo the tests' tasks read; `scale` times
    as many documents in each split (bench/chat_template_scores.py takes more)."""
    rng = random.Random(seed)
    k = scale
    arc = {s: _arc(rng, n * k) for s, n in (("train", 4), ("validation", 4), ("test", 8))}
    swag = {s: _hellaswag(rng, n * k, s) for s, n in (("train", 4), ("validation", 8), ("test", 2))}
    gsm = {s: _gsm8k(rng, n * k) for s, n in (("train", 6), ("test", 6))}
    mmlu = {s: _mmlu(rng, n * k) for s, n in (("dev", 5), ("validation", 3), ("test", 8))}
    wiki = {s: _wikitext(rng, n * k) for s, n in (("train", 2), ("validation", 2), ("test", 5))}
    return {
        "allenai/ai2_arc": _files("ARC-Easy", arc)
        | {"README.md": _readme({"ARC-Easy": ("ARC-Easy", list(arc))})},
        "Rowan/hellaswag": _files("data", swag)
        | {"README.md": _readme({"default": ("data", list(swag))})},
        "openai/gsm8k": _files("main", gsm) | {"README.md": _readme({"main": ("main", list(gsm))})},
        "cais/mmlu": _files("abstract_algebra", mmlu)
        | {"README.md": _readme({"abstract_algebra": ("abstract_algebra", list(mmlu))})},
        "EleutherAI/wikitext_document_level": _files("wikitext-2-raw-v1", wiki)
        | {"README.md": _readme({"wikitext-2-raw-v1": ("wikitext-2-raw-v1", list(wiki))})},
    }


def write_task_folders(root: Path, seed: int = 0, scale: int = 1) -> dict[str, Path]:
    """Each repo as a plain folder under `root`; repo id -> folder."""
    folders = {}
    for repo_id, files in build_task_repos(seed, scale).items():
        folder = root / repo_id.replace("/", "--")
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        folders[repo_id] = folder
    return folders


def cache_snapshot(cache: Path, repo_id: str, repo_type: str, files: dict[str, bytes]) -> Path:
    """`files` in the offline cache `cache` as download_models.py leaves a repo: a snapshot at a
    commit made from the id, and its manifest entry with the files' checksums. Returns the
    snapshot folder."""
    import hashlib

    from fsdp_utils.hub.cache import snapshot_dir
    from fsdp_utils.hub.manifest import FileRecord, ManifestEntry, record_entry

    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = snapshot_dir(cache, repo_id, repo_type, commit)
    for rel, data in files.items():
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).write_bytes(data)
    record_entry(
        cache,
        ManifestEntry(
            repo_id=repo_id, repo_type=repo_type, revision="main", commit=commit,
            files=tuple(
                FileRecord(rel, len(data), hashlib.sha256(data).hexdigest())
                for rel, data in sorted(files.items())
            ),
            repo_files=tuple(sorted(files)), endpoint="https://huggingface.co",
            downloaded_at="2026-01-01T00:00:00+00:00",
        ),
    )  # fmt: skip
    return snapshot


def cache_task_data(cache: Path, tasks: list[str], seed: int = 0) -> None:
    """The tasks' datasets in the offline cache `cache` as `download_models.py --eval_tasks`
    leaves them (a snapshot per repo, its manifest entry, the task record), without the
    mirror: for tests whose subject is what reads the cache, not the download."""
    from fsdp_utils.lm_harness.tasks import LeafTask, save_task_records

    repos = build_task_repos(seed)
    records = {}
    for task in tasks:
        repo_id, config = TASK_DATASETS[task]
        snapshot = cache_snapshot(cache, repo_id, "dataset", repos[repo_id])
        records[task] = [LeafTask(task, TASK_YAMLS[task], repo_id, config, snapshot.name)]
    save_task_records(cache, records)


def cache_arc_easy(cache: Path, documents: int, seed: int = 0) -> None:
    """arc_easy alone in the offline cache, as `cache_task_data` leaves it, with `documents`
    test questions: enough requests to time (bench/gpu_check.py's evaluation row)."""
    from fsdp_utils.lm_harness.tasks import LeafTask, save_task_records

    rng = random.Random(seed)
    splits = {"train": _arc(rng, 4), "validation": _arc(rng, 4), "test": _arc(rng, documents)}
    repo_id, config = TASK_DATASETS["arc_easy"]
    assert config is not None
    files = _files(config, splits) | {"README.md": _readme({config: (config, list(splits))})}
    snapshot = cache_snapshot(cache, repo_id, "dataset", files)
    task = LeafTask("arc_easy", TASK_YAMLS["arc_easy"], repo_id, config, snapshot.name)
    save_task_records(cache, {"arc_easy": [task]})
