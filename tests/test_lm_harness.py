"""Standard benchmarks through lm-evaluation-harness (fsdp_utils.lm_harness).

The acceptance test is equality with lm-eval's own `HFLM` on the same tiny model: every
per-request log-likelihood within 1e-4 relative, every generated text and every metric the
same, for a multiple-choice task (arc_easy), a rolling-loglikelihood task (wikitext, windows of
64 tokens so that documents roll) and a generation task (gsm8k), on one process (the adapter
itself) and on two processes with FSDP2 (`python -m fsdp_utils.evaluate` under torchrun, with
no network, reading the datasets that `download_models.py --eval_tasks` cached from the local
mirror). The datasets are small copies in their Hub layout (tests/lm_eval_data.py), read by
lm-eval's own task YAMLs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.hf_mirror import HubMirror, hub_mirror_fixture  # noqa: F401
from tests.lm_eval_data import TASK_DATASETS, write_task_folders

TASKS = ["arc_easy", "wikitext", "gsm8k"]  # multiple choice, rolling, generation
LIMIT = 4
MAX_LENGTH = 64
GEN_KWARGS = "max_gen_toks=24"
RTOL = 1e-4


@pytest.fixture(scope="module")
def eval_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose byte-level tokenizer adds BOS by itself (as Llama 3's does)."""
    from fsdp_utils.synthetic import save_chat_model

    return save_chat_model(tmp_path_factory.mktemp("eval_model") / "model", "llama3")


@pytest.fixture(scope="module")
def task_index() -> Any:
    """lm-eval's task index over the families the tests use (the whole index costs seconds)."""
    from lm_eval.tasks import TaskManager

    from fsdp_utils.lm_harness.tasks import lm_eval_tasks_dir

    families = ["arc", "gsm8k", "hellaswag", "mmlu", "wikitext"]
    root = lm_eval_tasks_dir()
    return TaskManager(include_path=[str(root / f) for f in families], include_defaults=False)


def eval_tasks(include: Path) -> Any:
    """The tests' tasks, reading the datasets through the override folder `include`."""
    from fsdp_utils.lm_harness.tasks import LeafTask, task_manager

    yamls = ["arc/arc_easy.yaml", "wikitext/wikitext.yaml", "gsm8k/gsm8k.yaml"]
    leaves = [LeafTask(t, y, "", None) for t, y in zip(TASKS, yamls, strict=True)]
    return task_manager(TASKS, leaves, include)


def reference(
    model_dir: Path, include: Path, *, bootstrap_iters: int = 0, tasks: list[str] = TASKS
) -> dict[str, Any]:
    """lm-eval's own HFLM on the tasks, reading the datasets through `include`."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    lm = HFLM(
        pretrained=model,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        batch_size=4,
        max_length=MAX_LENGTH,
        device="cpu",
    )
    return _evaluate(lm, include, bootstrap_iters, tasks)


def _evaluate(
    lm: Any, include: Path, bootstrap_iters: int, tasks: list[str] = TASKS
) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        lm,
        tasks=tasks,
        limit=LIMIT,
        gen_kwargs=GEN_KWARGS,
        log_samples=True,
        bootstrap_iters=bootstrap_iters,
        task_manager=eval_tasks(include),
    )
    assert results is not None
    return results


def _responses(samples: list[dict[str, Any]]) -> list[tuple[int, list[Any]]]:
    return sorted((s["doc_id"], [r[0] for r in s["resps"]]) for s in samples)


def assert_same_answers(ours: dict[str, Any], theirs: dict[str, Any]) -> int:
    """Every request's answer the same (log-likelihoods within RTOL), every metric equal.
    Returns how many requests were compared."""
    compared = 0
    for task in TASKS:
        for (doc, mine), (doc_ref, ref) in zip(
            _responses(ours[task]), _responses(theirs[task]), strict=True
        ):
            assert doc == doc_ref
            for a, b in zip(mine, ref, strict=True):
                compared += 1
                if isinstance(b, str):
                    assert a == b, (task, doc)
                    continue
                value, greedy = (a, None) if isinstance(b, float) else a
                value_ref, greedy_ref = (b, None) if isinstance(b, float) else b
                assert greedy == greedy_ref, (task, doc)
                assert value == pytest.approx(value_ref, rel=RTOL), (task, doc)
    return compared


def metrics(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task: results["results"][task] for task in TASKS}


def assert_same_metrics(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    for task in TASKS:
        mine, ref = ours[task], theirs[task]
        assert mine.keys() == ref.keys()
        for key, value in ref.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=RTOL), (task, key)
            else:
                assert mine[key] == value, (task, key)


# --- pieces ---------------------------------------------------------------------------------


def test_requests_are_dealt_so_every_rank_runs_the_same_forwards() -> None:
    from fsdp_utils.lm_harness.sharded_lm import deal

    order = [4, 0, 3, 1, 2]  # longest first
    shares = [deal(order, rank, 2) for rank in range(2)]
    assert [s.indices for s in shares] == [[4, 3, 2], [0, 1, 4]]  # rank 1 padded with a copy
    assert [s.real for s in shares] == [3, 2]
    assert deal([7], 1, 4).indices == [7] and deal([7], 1, 4).real == 0
    assert deal([], 0, 2).indices == []


def test_a_dataset_card_says_which_files_a_config_reads() -> None:
    from fsdp_utils.lm_harness.task_cache import TaskDataError, config_files

    card = (
        "---\nconfigs:\n- config_name: ARC-Easy\n  data_files:\n  - split: test\n"
        "    path: ARC-Easy/test-*\n- config_name: ARC-Challenge\n  data_files: ARC-C/*\n---\n"
    )
    assert config_files(card, "ARC-Easy") == ["ARC-Easy/test-*"]
    assert config_files(card, "ARC-Challenge") == ["ARC-C/*"]
    assert config_files("# no header\n", None) is None
    with pytest.raises(TaskDataError, match="no config 'main'"):
        config_files(card, "main")


def test_groups_expand_to_their_tasks_read_from_lm_evals_yamls(task_index: Any) -> None:
    from fsdp_utils.lm_harness.tasks import leaf_tasks

    manager = task_index
    mmlu = leaf_tasks("mmlu", manager)
    assert len(mmlu) == 57 and {leaf.dataset for leaf in mmlu} == {"cais/mmlu"}
    assert {leaf.task for leaf in mmlu} >= {"mmlu_abstract_algebra", "mmlu_world_religions"}
    (arc,) = leaf_tasks("arc_easy", manager)
    assert (arc.dataset, arc.config, arc.yaml) == (
        "allenai/ai2_arc",
        "ARC-Easy",
        "arc/arc_easy.yaml",
    )
    with pytest.raises(ValueError, match="no task, group or tag named 'arc_eazy'"):
        leaf_tasks("arc_eazy", manager)


# --- equality with HFLM ---------------------------------------------------------------------


def test_one_process_equals_hflm_request_by_request(
    eval_model: Path, task_index: Any, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.lm_harness.sharded_lm import ShardedLM
    from fsdp_utils.lm_harness.tasks import leaf_tasks, write_overrides

    folders = write_task_folders(tmp_path / "data")
    leaves = [leaf for task in TASKS for leaf in leaf_tasks(task, task_index)]
    include = tmp_path / "tasks"
    write_overrides(
        {leaf.task: folders[TASK_DATASETS[leaf.task][0]] for leaf in leaves},
        include,
        {leaf.task: leaf.yaml for leaf in leaves},
    )
    theirs = reference(eval_model, include)
    model = AutoModelForCausalLM.from_pretrained(eval_model, dtype="float32").eval()
    ours_lm = ShardedLM(
        model,
        AutoTokenizer.from_pretrained(eval_model),
        device=torch.device("cpu"),
        batch_size=3,
        max_length=MAX_LENGTH,
    )
    ours = _evaluate(ours_lm, include, bootstrap_iters=0)
    compared = assert_same_answers(ours["samples"], theirs["samples"])
    assert compared > 3 * LIMIT  # arc_easy's 4 choices per document, wikitext, gsm8k
    assert_same_metrics(metrics(ours), metrics(theirs))
    # Documents that share their context are one forward each: fewer rows than requests.
    assert ours_lm.forward_passes > 0


@pytest.mark.slow
def test_two_processes_offline_equal_hflm_from_the_download(
    hub_mirror: HubMirror, eval_model: Path, tiny_assets: dict[str, Path], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    cache = home / "hub"
    fetch = subprocess.run(
        [
            sys.executable,
            "download_models.py",
            "--eval_tasks",
            ",".join([*TASKS, "hellaswag", "mmlu_abstract_algebra", "ifeval"]),
            "--cache-dir",
            str(cache),
        ],
        env=hub_mirror.env(home),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # IFEval's data is not on the mirror: named at download time, the others recorded.
    assert fetch.returncode == 2, fetch.stdout + fetch.stderr
    assert "cannot be evaluated offline" in fetch.stderr
    assert "dataset google/IFEval (task(s) ifeval)" in fetch.stderr
    record = json.loads((cache / "lm-eval-tasks.json").read_text())
    assert sorted(record["tasks"]) == sorted([*TASKS, "hellaswag", "mmlu_abstract_algebra"])
    for name, leaves in record["tasks"].items():
        (leaf,) = leaves
        assert leaf["commit"] == hub_mirror.repos[leaf["dataset"]].commits["main"], name

    out = tmp_path / "results"
    evaluate = [
        "torchrun", "--standalone", "--nproc_per_node", "2", "-m", "fsdp_utils.evaluate",
        "--model", str(eval_model), "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
        "--max_length", str(MAX_LENGTH), "--gen_kwargs", GEN_KWARGS, "--batch_size", "3",
        "--log_samples", "--output_dir", str(out), "--cache_dir", str(cache),
        "--bootstrap_iters", "0",
    ]  # fmt: skip
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    script = "ip link set lo up; exec " + " ".join([torchrun, *evaluate[1:]])
    run = subprocess.run(
        ["unshare", "--net", "sh", "-c", script],
        env=hub_mirror.env(home),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FSDP2 over 2 process(es)" in run.stdout
    assert "|arc_easy|" in run.stdout  # lm-eval's table in the log
    (results_file,) = out.glob("results_*.json")
    ours = json.loads(results_file.read_text())
    samples = {
        task: [json.loads(line) for line in next(out.glob(f"samples_{task}_*.jsonl")).open()]
        for task in TASKS
    }
    # The results say what was evaluated, on which data.
    assert ours["fsdp_utils"]["model"]["world_size"] == 2
    assert ours["fsdp_utils"]["model"]["model_dir"] == str(eval_model)
    for task in TASKS:
        repo = TASK_DATASETS[task][0]
        assert (
            ours["fsdp_utils"]["datasets"][task]["commit"] == hub_mirror.repos[repo].commits["main"]
        )
        assert ours["versions"][task] is not None

    from fsdp_utils.lm_harness.tasks import offline_tasks

    include = tmp_path / "reference-tasks"
    offline_tasks(TASKS, cache, include)
    theirs = reference(eval_model, include)
    assert_same_answers(samples, theirs["samples"])
    assert_same_metrics(metrics(ours), metrics(theirs))

    # At the end of a training run, on the model in memory, sharded: the same scores as HFLM
    # gives the final model the run saved.
    from tests.train_helpers import run_finetune, tiny_args

    args = tiny_args(tiny_assets, tmp_path / "run", tmp_path / "data-cache", max_training_steps=2)
    args += ["--eval_tasks", "arc_easy", "--eval_limit", str(LIMIT), "--cache_dir", str(cache)]
    trained = run_finetune(2, args, env=hub_mirror.env(home, HF_HUB_OFFLINE="1"))
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    (end_file,) = (tmp_path / "run" / "lm_eval").glob("results_*.json")
    end = json.loads(end_file.read_text())["results"]["arc_easy"]
    assert f"arc_easy: acc {end['acc,none']:.4f}" in trained.stdout  # the end-of-run summary
    final = reference(tmp_path / "run" / "final", include, tasks=["arc_easy"])
    assert end["acc,none"] == final["results"]["arc_easy"]["acc,none"]
    assert end["acc_norm,none"] == final["results"]["arc_easy"]["acc_norm,none"]


def test_a_task_not_in_the_cache_names_the_download_command(
    eval_model: Path, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_utils.evaluate", "--model", str(eval_model),
         "--tasks", "arc_easy,boolq", "--cache_dir", str(tmp_path / "empty")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "python download_models.py --eval_tasks arc_easy,boolq" in result.stderr
    assert "Traceback" not in result.stderr


def test_compare_prints_base_against_this_with_standard_errors(tmp_path: Path) -> None:
    from fsdp_utils.lm_harness.compare import comparison_table, load_results

    def results(acc: float, se: float, ppl: float) -> dict[str, Any]:
        return {
            "results": {
                "arc_easy": {"alias": "arc_easy", "acc,none": acc, "acc_stderr,none": se},
                "wikitext": {"word_perplexity,none": ppl, "word_perplexity_stderr,none": "N/A"},
            }
        }

    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results(0.5, 0.03, 9.0)))
    (folder / "results_2026-02-01T00-00-00.json").write_text(json.dumps(results(0.6, 0.03, 8.0)))
    base = load_results(folder)  # the newest
    table = comparison_table(base, results(0.68, 0.04, 7.5), base_name="base")
    lines = table.splitlines()
    assert lines[0] == "compared with base:"
    assert lines[2].split() == ["arc_easy", "acc,none", "0.6000", "±", "0.0300", "0.6800", "±",
                                "0.0400", "+0.0800", "(+1.6", "se)"]  # fmt: skip
    assert lines[3].split() == ["wikitext", "word_perplexity,none", "8.0000", "7.5000", "-0.5000"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no results_"):
        load_results(tmp_path / "empty")


def test_download_reads_eval_tasks_from_a_training_config(tmp_path: Path) -> None:
    from fsdp_utils.hub.specs import load_assets_file

    config = tmp_path / "train.yaml"
    config.write_text("model: org/model\ndataset: org/data\neval_tasks: arc_easy, mmlu\n")
    assert load_assets_file(config).eval_tasks == ("arc_easy", "mmlu")
    assets = tmp_path / "assets.yaml"
    assets.write_text("assets: []\neval_tasks: [gsm8k]\n")
    assert load_assets_file(assets).eval_tasks == ("gsm8k",)
