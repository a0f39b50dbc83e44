"""How benchmark scores move with lm-eval's prompt options: plain text, the chat template with
the few-shot examples in one user message, as turns, and with a system instruction.

    python bench/chat_template_scores.py            # the table in docs/evaluate.md
    python bench/chat_template_scores.py --seed 1   # another tiny model
    python bench/chat_template_scores.py --scale 1  # the tests' 8 documents per task

The model is the tests' tiny chat model (a random 2-layer Llama, 64 wide, with Llama 3's chat
template: `fsdp_utils.synthetic.save_chat_model`), scored by this toolkit's `ShardedLM` on the
small copies of the benchmarks' datasets the tests build (tests/lm_eval_data.py: lm-eval's own
YAMLs over random pseudo-words), 8 times the tests' documents (64 per multiple-choice task, 48
for gsm8k), each task with its own few-shot count (gsm8k 5, the others 0). A random model on random words scores at chance whatever the prompt:
what the table shows is how much the prompt itself moves the numbers (its length, the
log-likelihood of the right answers, which answer wins) before any skill is involved. Writes
bench/results/chat_template_scores.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TASKS = ["arc_easy", "hellaswag", "mmlu_abstract_algebra", "gsm8k"]
SYSTEM = "You are a helpful assistant."
# name -> lm-eval's options (simple_evaluate's keywords)
SETTINGS: dict[str, dict[str, Any]] = {
    "plain text (lm-eval's default)": {},
    "--apply_chat_template --fewshot_as_multiturn false": {
        "apply_chat_template": True,
        "fewshot_as_multiturn": False,
    },
    "--apply_chat_template (few-shot as turns)": {
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
    },
    "... --system_instruction": {
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "system_instruction": SYSTEM,
    },
}


def score(lm: Any, include: Path, options: dict[str, Any]) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    from fsdp_utils.lm_harness.tasks import LeafTask, task_manager
    from tests.lm_eval_data import TASK_YAMLS

    leaves = [LeafTask(t, TASK_YAMLS[t], "", None) for t in TASKS]
    results = simple_evaluate(
        lm,
        tasks=TASKS,
        log_samples=True,
        bootstrap_iters=0,
        gen_kwargs="max_gen_toks=32",
        task_manager=task_manager(TASKS, leaves, include),
        **({"fewshot_as_multiturn": False} | options),
    )
    assert results is not None
    return results


MULTIPLE_CHOICE = ["arc_easy", "hellaswag", "mmlu_abstract_algebra"]


def choices(results: dict[str, Any]) -> dict[tuple[str, int], int]:
    """(task, document) -> the answer the model picked (the highest log-likelihood)."""
    picked = {}
    for task in MULTIPLE_CHOICE:
        for sample in results["samples"][task]:
            scores = [r[0][0] for r in sample["resps"]]
            picked[(task, sample["doc_id"])] = scores.index(max(scores))
    return picked


def summarise(
    results: dict[str, Any], lm: Any, plain: dict[tuple[str, int], int] | None
) -> dict[str, float]:
    """The row of the table: the scores, the prompts' length, the right answers'
    log-likelihood (arc_easy), and how many multiple-choice answers differ from plain text's."""
    scores = results["results"]
    picked = choices(results)
    changed = sum(picked[k] != v for k, v in plain.items()) / len(plain) if plain else 0.0
    lengths = [
        len(lm.tok_encode(sample["arguments"][0][0]))
        for task in TASKS
        for sample in results["samples"][task]
    ]
    gold = [
        sample["resps"][int(sample["target"])][0][0] for sample in results["samples"]["arc_easy"]
    ]
    return {
        "prompt tokens (mean)": statistics.mean(lengths),
        "arc_easy acc": scores["arc_easy"]["acc,none"],
        "arc_easy acc_norm": scores["arc_easy"]["acc_norm,none"],
        "arc_easy right answer's log-likelihood (mean)": statistics.mean(gold),
        "hellaswag acc_norm": scores["hellaswag"]["acc_norm,none"],
        "mmlu_abstract_algebra acc": scores["mmlu_abstract_algebra"]["acc,none"],
        "gsm8k exact_match (flexible)": float(scores["gsm8k"]["exact_match,flexible-extract"]),
        "multiple-choice answers not plain text's": changed,
    }


def markdown(rows: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(rows.values())))
    lines = [
        "| setting | " + " | ".join(columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for name, row in rows.items():
        cells = [f"{row[c]:.1f}" if "mean" in c else f"{row[c]:.3f}" for c in columns]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the tiny model's initialisation")
    parser.add_argument(
        "--scale", type=int, default=8, help="documents: 8 x this per multiple-choice task"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # tests/lm_eval_data.py: the datasets' small copies
    with tempfile.TemporaryDirectory() as tmp:
        # The datasets library caches a folder's dataset by its name, not its contents: a
        # cache of its own, or another --scale would read the last one's documents.
        os.environ["HF_DATASETS_CACHE"] = str(Path(tmp) / "datasets")
        rows = measure(Path(tmp), seed=args.seed, scale=args.scale)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chat_template_scores.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown(rows)
    (RESULTS / "chat_template_scores.md").write_text(table + "\n")
    print(table)


def measure(root: Path, *, seed: int, scale: int) -> dict[str, dict[str, float]]:
    """One row per setting (SETTINGS), the model and data built under `root`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from fsdp_utils.lm_harness.sharded_lm import ShardedLM
    from fsdp_utils.lm_harness.tasks import quiet_task_logs, write_overrides
    from fsdp_utils.synthetic import save_chat_model
    from tests.lm_eval_data import TASK_DATASETS, TASK_YAMLS, write_task_folders

    quiet_task_logs()
    hf_logging.disable_progress_bar()
    model_dir = save_chat_model(root / "model", "llama3", seed=seed)
    folders = write_task_folders(root / "data", scale=scale)
    include = root / "tasks"
    write_overrides(
        {t: folders[TASK_DATASETS[t][0]] for t in TASKS}, include, {t: TASK_YAMLS[t] for t in TASKS}
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    lm = ShardedLM(
        model,
        AutoTokenizer.from_pretrained(model_dir),
        device=torch.device("cpu"),
        batch_size=8,
        max_length=1024,
    )
    rows: dict[str, dict[str, float]] = {}
    plain = None
    with torch.no_grad():
        for name, options in SETTINGS.items():
            results = score(lm, include, options)
            rows[name] = summarise(results, lm, plain)
            plain = plain or choices(results)
            print(name, json.dumps(rows[name]), flush=True)
    return rows


if __name__ == "__main__":
    main()
