"""Standard benchmarks through lm-evaluation-harness (fsdp_utils.lm_harness).

The acceptance test is equality with lm-eval's own `HFLM` on the same tiny model: every
per-request log-likelihood within 1e-4 relative, every generated text and every metric the
same, for multiple-choice tasks (arc_easy, hellaswag, an MMLU subject), a rolling-loglikelihood
task (wikitext, windows of 64 tokens so that documents roll) and a generation task (gsm8k), on
one process (the adapter itself) and on two processes with FSDP2 (`python -m
fsdp_utils.evaluate` as torchrun's workers, with no network, reading the datasets that
`download_models.py --eval_tasks` cached from the local mirror). Then each form `--model` takes
(a hub id in the cache, a run folder, a LoRA adapter over its base) against HFLM on the same
model. The datasets are small copies in their Hub layout (tests/lm_eval_data.py), read by
lm-eval's own task YAMLs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_utils.lm_harness.tasks import offline_tasks
from tests.conftest import REPO_ROOT
from tests.hf_mirror import HubMirror, hub_mirror_fixture  # noqa: F401
from tests.lm_eval_checks import (
    RTOL,
    assert_same_answers,
    assert_same_metrics,
    evaluate_in_process,
    responses,
)
from tests.lm_eval_data import (
    TASK_DATASETS,
    TASK_YAMLS,
    cache_snapshot,
    cache_task_data,
    write_task_folders,
)
from tests.prefork import launch
from tests.train_helpers import run_module

# multiple choice (arc_easy; hellaswag, whose answers are whole sentences; an MMLU subject, whose
# one-letter answers share one forward), rolling (wikitext), generation (gsm8k)
TASKS = ["arc_easy", "hellaswag", "mmlu_abstract_algebra", "wikitext", "gsm8k"]
LIMIT = 4
MAX_LENGTH = 64
GEN_KWARGS = "max_gen_toks=24"


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


def eval_tasks(include: Path, tasks: list[str] = TASKS) -> Any:
    """The tests' tasks, reading the datasets through the override folder `include`."""
    from fsdp_utils.lm_harness.tasks import LeafTask, task_manager

    leaves = [LeafTask(t, TASK_YAMLS[t], "", None) for t in tasks]
    return task_manager(tasks, leaves, include)


def reference(
    model_dir: Path, include: Path, *, bootstrap_iters: int = 0, tasks: list[str] = TASKS
) -> dict[str, Any]:
    """lm-eval's own HFLM on the tasks, reading the datasets through `include`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return hflm(model, model_dir, include, bootstrap_iters=bootstrap_iters, tasks=tasks)


def hflm(
    model: Any,
    tokenizer_dir: Path,
    include: Path,
    *,
    bootstrap_iters: int = 0,
    tasks: list[str] = TASKS,
) -> dict[str, Any]:
    """lm-eval's HFLM over `model` (a transformers or PEFT model) on the tasks."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    lm = HFLM(
        pretrained=model,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
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
        task_manager=eval_tasks(include, tasks),
    )
    assert results is not None
    return results


def metrics(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {task: results["results"][task] for task in TASKS}


# --- pieces ---------------------------------------------------------------------------------


def test_requests_are_dealt_so_every_rank_runs_the_same_forwards() -> None:
    from fsdp_utils.lm_harness.sharded_lm import deal

    order = [4, 0, 3, 1, 2]  # longest first
    shares = [deal(order, rank, 2) for rank in range(2)]
    # Rank 1 is padded with a copy of the shortest: at every place rank 0's is the longest.
    assert [s.indices for s in shares] == [[4, 3, 2], [0, 1, 2]]
    assert [s.real for s in shares] == [3, 2]
    assert deal([7], 1, 4).indices == [7] and deal([7], 1, 4).real == 0
    assert deal([], 0, 2).indices == []


def test_batch_size_auto_fills_forwards_up_to_the_planned_tokens(eval_model: Path) -> None:
    """`--batch_size auto`: on CPU a fixed default; on GPUs the memory plan's token budget
    sizes each forward by its longest row (at most AUTO_MAX_ROWS rows), the same on every
    rank. The plan traces the evaluation's forward on fake tensors: its bytes per row hold
    at least the row's logits, and its rows are what fits in the GPU beside the model."""
    import torch

    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.lm_harness.cli import AUTO_MAX_ROWS, CPU_BATCH, build_parser
    from fsdp_utils.lm_harness.sharded_lm import ShardedLM, batch_sizes, deal
    from fsdp_utils.plan.estimate import Cluster
    from fsdp_utils.plan.hardware import GIB, Gpu
    from fsdp_utils.plan.inference import plan_forward
    from fsdp_utils.plan.report import Margin

    parse = build_parser().parse_args
    assert parse(["--model", "m", "--tasks", "t"]).batch_size == "auto"
    assert parse(["--model", "m", "--tasks", "t", "--batch_size", "3"]).batch_size == 3
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--tasks", "t", "--batch_size", "0"])
    assert (CPU_BATCH, AUTO_MAX_ROWS) == (8, 64)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = eval_model
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lm = ShardedLM(
        model, AutoTokenizer.from_pretrained(model_dir), device=torch.device("cpu"),
        batch_size=AUTO_MAX_ROWS, token_budget=100,
    )  # fmt: skip
    assert [lm.rows_for(n) for n in (1, 40, 50, 51, 100, 300)] == [64, 2, 2, 1, 1, 1]
    # Places' longest lengths over the ranks, longest first: batches by their first place.
    assert batch_sizes([60, 50, 30, 30, 20, 10, 10], lm.rows_for) == [1, 2, 3, 1]
    assert batch_sizes([5, 5], lambda n: 8) == [2]
    # Two ranks compute the same places' lengths from the same order: rank 0 holds the longest.
    lengths = {0: 9, 1: 7, 2: 7, 3: 4, 4: 1}
    shares = [deal(list(lengths), rank, 2).indices for rank in range(2)]
    assert all(lengths[shares[0][j]] >= lengths[shares[1][j]] for j in range(3))

    config = TrainConfig(model=str(model_dir), precision="fp32", gradient_checkpointing=False)
    gpu = Gpu("test", 3 * GIB)
    plan = plan_forward(config, Cluster(1, 2), gpu, seq_len=128, margin=Margin(GIB, 0.10))
    assert plan.bytes_per_row >= 128 * model.config.vocab_size * 4  # at least its fp32 logits
    assert plan.seq_len == 128 and plan.token_budget == plan.rows * 128
    used = plan.fixed_bytes + plan.rows * plan.bytes_per_row
    margin = Margin(GIB, 0.10).bytes_for(plan.fixed_bytes + plan.bytes_per_row)
    assert used + margin <= gpu.memory_bytes < used + margin + plan.bytes_per_row
    assert "row(s) of 128 tokens per forward" in plan.describe()

    # The command plans the model --model names, at --max_length tokens a row, before it joins
    # the process group; with no GPU visible the plan says so.
    from fsdp_utils.evaluate import plan_token_budget
    from fsdp_utils.lm_harness.cli import planned_budget

    seen: list[tuple[Any, int]] = []
    lines: list[str] = []

    def planner(config: Any, seq_len: int) -> tuple[int, str]:
        seen.append((config, seq_len))
        return 1234, "planned"

    args = parse(["--model", str(model_dir), "--tasks", "t", "--max_length", "96"])
    assert planned_budget(args, planner, lines.append) == 1234 and lines == ["planned"]
    ((planned_config, seq_len),) = seen
    assert (planned_config.model, planned_config.precision, seq_len) == (str(model_dir), "fp32", 96)
    with pytest.raises(ValueError, match="none is visible"):
        plan_token_budget(planned_config, 96)


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
    # The download's index: only the folders whose files declare the names, the same leaves.
    from fsdp_utils.lm_harness.tasks import leaves_of

    assert leaves_of(["mmlu", "arc_easy"]) == ({"mmlu": mmlu, "arc_easy": [arc]}, [])


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
    compared = assert_same_answers(ours["samples"], theirs["samples"], TASKS)
    assert compared.requests > 3 * LIMIT  # arc_easy's 4 choices per document, wikitext, gsm8k
    assert_same_metrics(metrics(ours), metrics(theirs), TASKS)
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
            ",".join([*TASKS, "ifeval"]),
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
    assert sorted(record["tasks"]) == sorted(TASKS)
    for name, leaves in record["tasks"].items():
        (leaf,) = leaves
        assert leaf["commit"] == hub_mirror.repos[leaf["dataset"]].commits["main"], name

    out = tmp_path / "results"
    evaluate = [
        "fsdp_utils.evaluate",
        "--model", str(eval_model), "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
        "--max_length", str(MAX_LENGTH), "--gen_kwargs", GEN_KWARGS, "--batch_size", "3",
        "--log_samples", "--output_dir", str(out), "--cache_dir", str(cache),
        "--bootstrap_iters", "0",
    ]  # fmt: skip
    # Two processes as torchrun's workers with no network but loopback, as on a compute node:
    # forked from tests/prefork.py's server started under `unshare --net` (the launcher is not
    # the point here; torchrun and two new interpreters cost ~20 s of CPU more).
    run = launch(
        2, "-m", evaluate, env=hub_mirror.env(home), timeout=400, distributed=True, network=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FSDP2 over 2 process(es)" in run.stdout
    assert re.search(r"\|arc_easy +\|", run.stdout)  # lm-eval's table in the log
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

    include = tmp_path / "reference-tasks"
    offline_tasks(TASKS, cache, include)
    theirs = reference(eval_model, include)
    assert_same_answers(samples, theirs["samples"], TASKS)
    assert_same_metrics(metrics(ours), metrics(theirs), TASKS)

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
    result = run_module(
        "fsdp_utils.evaluate", "--model", str(eval_model), "--tasks", "arc_easy,boolq",
        "--cache_dir", str(tmp_path / "empty"),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "python download_models.py --eval_tasks arc_easy,boolq" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_task_is_no_such_task_on_the_compute_node_and_the_login_node(
    eval_model: Path, tmp_path: Path
) -> None:
    """Issue 48: a typo was answered "holds no datasets ... run download_models.py", and only
    that command then said lm-eval has no such task. On a compute node (no network: `unshare
    --net`) and on the login node, the typo is named at once, with lm-eval's closest names."""
    evaluate = ["fsdp_utils.evaluate", "--model", str(eval_model), "--tasks", "arc_esy,boolq",
                "--cache_dir", str(tmp_path / "empty")]  # fmt: skip
    # Forked from tests/prefork.py's server started under `unshare --net` (loopback up: the
    # process group's store listens on it), as `python -m fsdp_utils.evaluate` on the node.
    compute = launch(1, "-m", evaluate, timeout=300, network=False)
    # The login node's command, forked from tests/prefork.py's pre-imported server.
    login_args = ["--eval_tasks", "arc_esy,boolq", "--cache-dir", str(tmp_path / "empty")]
    login = launch(1, "download_models.py", login_args, timeout=300)
    for result in (compute, login):
        assert result.returncode == 2, result.stdout + result.stderr
        assert "has no task, group or tag named 'arc_esy' (closest: arc_easy" in result.stderr
        assert "--eval_tasks arc_esy" not in result.stderr  # no download for a typo
        assert "Traceback" not in result.stderr


def test_the_local_task_of_evaluate_md_builds_offline_with_lm_evals_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48: evaluate.md had no complete task YAML for a user's own task. Its example (the
    data and the YAML, read from the page) is a task lm-eval builds from the local file."""
    from lm_eval.tasks import TaskManager, get_task_dict

    page = (REPO_ROOT / "docs" / "evaluate.md").read_text().split("## Your own task", 1)[1]
    data = page.split("```json\n", 1)[1].split("```", 1)[0]
    yaml = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "capitals.jsonl").write_text(data)
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "capitals.yaml").write_text(yaml)
    monkeypatch.chdir(tmp_path)  # the data file's path is relative to where the command runs
    manager = TaskManager(include_path=str(tmp_path / "my_tasks"), include_defaults=False)
    task = get_task_dict(["capitals"], manager)["capitals"]
    docs = list(task.test_docs())
    assert len(docs) == 3 and task.OUTPUT_TYPE == "multiple_choice"
    assert task.doc_to_text(docs[0]) == "Question: What is the capital of France?\nAnswer:"
    assert task.doc_to_choice(docs[2]) == ["Seville", "Valencia", "Madrid"]
    assert [task.doc_to_target(doc) for doc in docs] == [0, 1, 2]


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


# --- what --model names ---------------------------------------------------------------------

HUB_ID = "org/tiny-llama"


@pytest.fixture(scope="module")
def lora_run_over_a_cached_base(
    eval_model: Path, tiny_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """One short LoRA run (one process, 2 steps) whose base is a hub id in the offline cache:
    its run folder's final/ is an adapter folder naming that id as its base."""
    from tests.train_helpers import check_ok, run_finetune, tiny_args

    root = tmp_path_factory.mktemp("lora_over_cache")
    cache = root / "hub"
    files = {p.name: p.read_bytes() for p in eval_model.iterdir() if p.is_file()}
    snapshot = cache_snapshot(cache, HUB_ID, "model", files)
    cache_task_data(cache, ["arc_easy"])
    args = tiny_args(
        tiny_assets, root / "run", root / "data-cache", model=HUB_ID, cache_dir=cache,
        lora=True, lora_dropout=0.0, max_training_steps=2, learning_rate=5e-2,
    )  # fmt: skip
    check_ok(run_finetune(1, args))
    return {"cache": cache, "snapshot": snapshot, "run": root / "run"}


@pytest.mark.slow
def test_a_run_folder_a_lora_adapter_and_a_hub_id_equal_hflm(
    lora_run_over_a_cached_base: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--model RUN`: the run's final/ model, here a LoRA adapter folder, over the base its
    adapter_config.json names, a hub id resolved in the offline cache; `--model HUB_ID`: that
    snapshot. Each scores as HFLM does on the same model (PEFT's for the adapter), and the
    adapter's scores are not the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, cache, snapshot = (lora_run_over_a_cached_base[k] for k in ("run", "cache", "snapshot"))
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == HUB_ID
    common = ["--tasks", "arc_easy", "--limit", str(LIMIT), "--max_length", str(MAX_LENGTH),
              "--cache_dir", str(cache), "--log_samples", "--bootstrap_iters", "0"]  # fmt: skip
    assert evaluate_in_process(monkeypatch, "--model", str(run), *common) == 0
    out = ["--output_dir", str(tmp_path)]
    assert evaluate_in_process(monkeypatch, "--model", HUB_ID, *common, *out) == 0

    def read(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        (results,) = folder.glob("results_*.json")
        (samples,) = folder.glob("samples_arc_easy_*.jsonl")
        return json.loads(results.read_text()), [json.loads(s) for s in samples.open()]

    tuned, tuned_samples = read(run / "lm_eval")  # a run folder's results go into it
    base, base_samples = read(tmp_path)
    assert tuned["fsdp_utils"]["model"] | {"precision": "fp32"} == {
        "model": str(run), "model_dir": str(snapshot), "model_commit": snapshot.name,
        "adapter_dir": str(run / "final"), "run_dir": str(run), "precision": "fp32",
        "world_size": 1,
    }  # fmt: skip
    assert base["fsdp_utils"]["model"]["model"] == HUB_ID
    assert base["fsdp_utils"]["model"]["adapter_dir"] is None

    include = tmp_path / "reference-tasks"
    offline_tasks(["arc_easy"], cache, include)
    base_model = AutoModelForCausalLM.from_pretrained(snapshot, dtype="float32").eval()
    theirs_base = hflm(base_model, snapshot, include, tasks=["arc_easy"])
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(snapshot, dtype="float32"), run / "final"
    ).eval()
    theirs_tuned = hflm(peft, run / "final", include, tasks=["arc_easy"])
    for ours, ours_samples, theirs in (
        (tuned, tuned_samples, theirs_tuned),
        (base, base_samples, theirs_base),
    ):
        assert_same_answers({"arc_easy": ours_samples}, theirs["samples"], ["arc_easy"])
        assert_same_metrics(ours["results"], theirs["results"], ["arc_easy"])
    changed = [
        abs(a[0] - b[0]) / abs(b[0])
        for s, t in zip(responses(tuned_samples), responses(base_samples), strict=True)
        for a, b in zip(s[1], t[1], strict=True)
    ]
    assert max(changed) > 100 * RTOL  # the adapter moved the scores


@pytest.mark.slow
def test_a_qlora_run_scores_over_its_nf4_base_in_the_run_and_from_its_folder(
    tiny_assets: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A QLoRA run (one process, 2 steps, --merge) scored by --eval_tasks at its end on the model
    in memory, and `--model RUN` later: both the adapter over the NF4 base it trained on, so both
    answer as HFLM does on the merged model (the NF4 base dequantized, the adapters merged)."""
    from transformers import AutoModelForCausalLM

    from fsdp_utils.synthetic import save_chat_model
    from tests.train_helpers import check_ok, run_finetune, tiny_args

    cache = tmp_path / "hub"
    model = save_chat_model(tmp_path / "model", "llama3", hidden_size=256)  # NF4's sizes
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    cache_snapshot(cache, "org/tiny-llama-256", "model", files)
    cache_task_data(cache, ["arc_easy"])
    run = tmp_path / "run"
    args = tiny_args(
        tiny_assets, run, tmp_path / "data-cache", model="org/tiny-llama-256", cache_dir=cache,
        qlora=True, lora_dropout=0.0, max_training_steps=2, learning_rate=5e-2, merge=True,
    )  # fmt: skip
    args += ["--eval_tasks", "arc_easy", "--eval_limit", str(LIMIT)]
    check_ok(run_finetune(1, args))
    (in_run_file,) = (run / "lm_eval").glob("results_*.json")
    in_run = json.loads(in_run_file.read_text())["results"]["arc_easy"]

    out = tmp_path / "evaluated"
    common = ["--tasks", "arc_easy", "--limit", str(LIMIT), "--max_length", str(MAX_LENGTH),
              "--cache_dir", str(cache), "--log_samples", "--bootstrap_iters", "0"]  # fmt: skip
    evaluate_in_process(monkeypatch, "--model", str(run), *common, "--output_dir", str(out))
    (results_file,) = out.glob("results_*.json")
    (samples_file,) = out.glob("samples_arc_easy_*.jsonl")
    ours = json.loads(results_file.read_text())
    assert ours["fsdp_utils"]["model"]["quantize"] == "nf4"

    include = tmp_path / "reference-tasks"
    offline_tasks(["arc_easy"], cache, include)
    merged = AutoModelForCausalLM.from_pretrained(run / "final_merged", dtype="float32").eval()
    theirs = hflm(merged, run / "final_merged", include, tasks=["arc_easy"])
    samples = [json.loads(line) for line in samples_file.open()]
    assert_same_answers({"arc_easy": samples}, theirs["samples"], ["arc_easy"])
    assert_same_metrics(ours["results"], theirs["results"], ["arc_easy"])
    for metric in ("acc,none", "acc_norm,none"):
        assert in_run[metric] == theirs["results"]["arc_easy"][metric]


def _results(model: str, scores: dict[str, dict[str, float | str]]) -> dict[str, Any]:
    """Results in lm-eval's layout, with its `higher_is_better` for the metrics used here."""
    better = {"acc": True, "acc_norm": True, "exact_match": True, "word_perplexity": False}
    better |= {f"{k}_stderr": v for k, v in better.items()}  # never read: lm-eval lists them
    return {
        "results": {task: {"alias": task, **values} for task, values in scores.items()},
        "higher_is_better": {
            task: {k.partition(",")[0]: better[k.partition(",")[0]] for k in values}
            for task, values in scores.items()
        },
        "fsdp_utils": {"model": {"model": model}},
    }


def test_plot_draws_the_comparison_with_standard_errors(tmp_path: Path) -> None:
    """`python -m fsdp_utils.plot --compare BASE RESULTS`: one panel per metric, each task's
    base and fine-tuned bars at their values with their standard errors as error bars (read
    back from the figure's artists), the direction of better from lm-eval, the CSV beside."""
    import csv

    from fsdp_utils.lm_harness.compare_plot import plot_comparison
    from fsdp_utils.plot import main as plot_main

    base = _results("org/base", {
        "arc_easy": {"acc,none": 0.60, "acc_stderr,none": 0.03, "acc_norm,none": 0.55,
                     "acc_norm_stderr,none": 0.025},
        "hellaswag": {"acc,none": 0.40, "acc_stderr,none": 0.02},
        "wikitext": {"word_perplexity,none": 9.0, "word_perplexity_stderr,none": "N/A"},
        "boolq": {"acc,none": 0.7, "acc_stderr,none": 0.01},  # the other side lacks it
    })  # fmt: skip
    tuned = _results("runs/chess", {
        "arc_easy": {"acc,none": 0.68, "acc_stderr,none": 0.04, "acc_norm,none": 0.50,
                     "acc_norm_stderr,none": 0.02},
        "hellaswag": {"acc,none": 0.45, "acc_stderr,none": 0.01},
        "wikitext": {"word_perplexity,none": 7.5, "word_perplexity_stderr,none": "N/A"},
    })  # fmt: skip
    fig, _ = plot_comparison(base, tuned, labels=("org/base", "runs/chess"))
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    assert sorted(axes) == [
        "acc,none (higher is better)", "acc_norm,none (higher is better)",
        "word_perplexity,none (lower is better)",
    ]  # fmt: skip
    drawn = {}
    for title, ax in axes.items():
        labels = [t.get_text() for t in ax.get_yticklabels()]
        ticks = dict(zip(ax.get_yticks(), labels, strict=True))
        bars = [c for c in ax.containers if hasattr(c, "patches") and c.patches]
        assert [c.get_label() for c in bars] == ["org/base", "runs/chess"]
        for side, container in zip(("base", "this"), bars, strict=True):
            segments = container.errorbar.lines[2][0].get_segments()
            for patch, segment in zip(container.patches, segments, strict=True):
                middle = patch.get_y() + patch.get_height() / 2
                task = ticks[min(ticks, key=lambda tick: abs(tick - middle))]  # the nearest label
                half = None  # no standard error: no error bar drawn
                if len(segment):
                    (low, y0), (high, y1) = segment
                    assert y0 == y1 == pytest.approx(middle)  # the error bar on its bar
                    half = round(float(high - low) / 2, 9)
                drawn[(title.split()[0], task, side)] = (float(patch.get_width()), half)
    assert drawn == {
        ("acc,none", "arc_easy", "base"): (0.60, 0.03),
        ("acc,none", "arc_easy", "this"): (0.68, 0.04),
        ("acc,none", "hellaswag", "base"): (0.40, 0.02),
        ("acc,none", "hellaswag", "this"): (0.45, 0.01),
        ("acc_norm,none", "arc_easy", "base"): (0.55, 0.025),
        ("acc_norm,none", "arc_easy", "this"): (0.50, 0.02),
        ("word_perplexity,none", "wikitext", "base"): (9.0, None),  # lm-eval gives no stderr
        ("word_perplexity,none", "wikitext", "this"): (7.5, None),
    }
    # The first task is on top; the change is written beside each pair.
    acc = axes["acc,none (higher is better)"]
    top = max(zip(acc.get_yticks(), acc.get_yticklabels(), strict=True), key=lambda t: t[0])
    assert top[1].get_text() == "arc_easy"
    assert "+0.0800 (+1.6 se)" in [t.get_text() for t in acc.texts]

    for name, results in (("base", base), ("tuned", tuned)):
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    out = tmp_path / "plots" / "compare.png"
    argv = ["--compare", str(tmp_path / "base.json"), str(tmp_path / "tuned.json"), "-o", str(out)]
    assert plot_main(argv) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert [(r["task"], r["metric"], r["base"], r["this"]) for r in rows][:2] == [
        ("arc_easy", "acc,none", "0.6", "0.68"), ("hellaswag", "acc,none", "0.4", "0.45"),
    ]  # fmt: skip
    (tmp_path / "other.json").write_text(json.dumps(_results("x", {"piqa": {"acc,none": 0.5}})))
    argv[2] = str(tmp_path / "other.json")
    assert plot_main(argv) == 2  # nothing in common: one paragraph, exit 2


def test_check_offline_builds_the_cached_tasks_and_names_missing_task_data(
    tmp_path: Path,
) -> None:
    """The tasks' part of `download_models.py --check-offline`: every recorded task builds from
    the cache alone; a task whose dataset snapshot is gone is named, with the command that
    fetches it again, and the check fails (in a process with no network, as a node runs it)."""
    import shutil

    from fsdp_utils.lm_harness.task_cache import check_tasks
    from fsdp_utils.lm_harness.tasks import load_task_records

    cache = tmp_path / "hub"
    cache_task_data(cache, ["arc_easy", "gsm8k"])
    lines: list[str] = []
    assert check_tasks(load_task_records(cache), cache, log=lines.append) == {}
    assert lines == [
        "OK   lm-eval arc_easy: 1 task(s), 8 documents",
        "OK   lm-eval gsm8k: 1 task(s), 6 documents",
    ]
    (leaf,) = load_task_records(cache)["gsm8k"]
    shutil.rmtree(cache / "datasets--openai--gsm8k" / "snapshots" / str(leaf.commit))
    check = launch(1, "download_models.py", ["--check-offline", "--cache-dir", str(cache)])
    assert check.returncode == 1, check.stdout + check.stderr
    assert "OK   lm-eval arc_easy: 1 task(s), 8 documents" in check.stdout
    failed = check.stdout.split("FAIL lm-eval gsm8k: ", 1)[1]
    assert failed.startswith("Dataset openai/gsm8k of task gsm8k")
    assert "is not in the offline cache" in failed
    assert failed.splitlines()[1].strip() == "python download_models.py --eval_tasks gsm8k"
