"""Benchmarks scored the way chat models are: lm-eval's --apply_chat_template,
--fewshot_as_multiturn, --system_instruction, --gen_kwargs and --seed
(fsdp_utils.lm_harness.scoring).

The acceptance test is again equality with lm-eval's own HFLM on the same tiny model, now one
with a chat template (Llama 3's shape: the template writes BOS and a header per turn): a
multiple-choice task (arc_easy) and a generation task (gsm8k), both 2-shot with the examples as
chat turns under a system instruction, every per-request log-likelihood within 1e-4 relative,
every generated text and every metric identical, on one process (the model in this process)
and on two (`python -m fsdp_utils.evaluate` under torchrun). The same runs sample a third task
(gsm8k's copy with do_sample, temperature and top_p in its YAML): the same texts on one process
and on two, from the same seed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.lm_eval_checks import (
    assert_same_answers,
    assert_same_metrics,
    evaluate_in_process,
    responses,
)
from tests.lm_eval_data import TASK_YAMLS, cache_task_data
from tests.train_helpers import run_script

TASKS = ["arc_easy", "gsm8k"]  # multiple choice, generation
SAMPLED = "gsm8k_sampled"  # gsm8k with sampling in its YAML (see user_tasks)
LIMIT = 4
NUM_FEWSHOT = 2
MAX_LENGTH = 512  # two examples as turns, each with the template's headers
GEN_KWARGS = "max_gen_toks=16"
SYSTEM = "be brief"
SEED = 5  # lm-eval's --seed 5: python, numpy, torch (sampling) and the few-shot examples
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "max_gen_toks": 16}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama with Llama 3's chat template; the tasks' data in an offline cache; the
    override folder reading it; a user task folder with the sampled copy of gsm8k."""
    from fsdp_utils.lm_harness.tasks import lm_eval_tasks_dir, offline_tasks
    from fsdp_utils.synthetic import save_chat_model

    root = tmp_path_factory.mktemp("lm_eval_chat")
    cache = root / "hub"
    cache_task_data(cache, TASKS)
    include = root / "tasks"
    offline_tasks(TASKS, cache, include)
    user = root / "user_tasks"
    user.mkdir()
    (user / f"{SAMPLED}.yaml").write_text(
        f"include: {json.dumps(str(lm_eval_tasks_dir() / TASK_YAMLS['gsm8k']))}\n"
        f"task: {SAMPLED}\n"
        f"dataset_path: {json.dumps(str(include_dataset(include, 'gsm8k')))}\n"
        f"generation_kwargs: {json.dumps({'until': ['Question:'], **SAMPLING})}\n"
    )
    return {
        "model": save_chat_model(root / "model", "llama3"),
        "cache": cache,
        "include": include,
        "user": user,
    }


def include_dataset(include: Path, task: str) -> Path:
    """The dataset folder an override YAML of `include` reads."""
    line = next(
        x for x in (include / f"{task}.yaml").read_text().splitlines() if "dataset_path" in x
    )
    return Path(json.loads(line.split(":", 1)[1]))


def evaluate(lm: Any, assets: dict[str, Path], tasks: list[str]) -> dict[str, Any]:
    """lm-eval's simple_evaluate on `lm`, scored as chat models are."""
    from lm_eval import simple_evaluate

    from fsdp_utils.lm_harness.tasks import LeafTask, task_manager

    leaves = [LeafTask(t, TASK_YAMLS[t], "", None) for t in TASKS]
    results = simple_evaluate(
        lm,
        tasks=tasks,
        limit=LIMIT,
        num_fewshot=NUM_FEWSHOT,
        gen_kwargs=GEN_KWARGS,
        log_samples=True,
        bootstrap_iters=0,
        task_manager=task_manager(tasks, leaves, assets["include"], [str(assets["user"])]),
        apply_chat_template=True,
        fewshot_as_multiturn=True,
        system_instruction=SYSTEM,
        random_seed=SEED,
        numpy_random_seed=SEED,
        torch_random_seed=SEED,
        fewshot_random_seed=SEED,
    )
    assert results is not None
    return results


@pytest.fixture(scope="module")
def one_process(assets: dict[str, Path]) -> dict[str, Any]:
    """HFLM on the two tasks, and this toolkit's model in this process on them and the sampled
    one: shared by the one- and two-process checks."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.lm_harness.sharded_lm import ShardedLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    hflm = HFLM(
        pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=MAX_LENGTH, device="cpu"
    )
    ours = ShardedLM(
        model, AutoTokenizer.from_pretrained(assets["model"]), device=torch.device("cpu"),
        batch_size=3, max_length=MAX_LENGTH, seed=SEED,
    )  # fmt: skip
    return {
        "hflm": evaluate(hflm, assets, TASKS),
        "ours": evaluate(ours, assets, [*TASKS, SAMPLED]),
    }


def test_chat_scoring_on_one_process_equals_hflm(one_process: dict[str, Any]) -> None:
    ours, theirs = one_process["ours"], one_process["hflm"]
    compared = assert_same_answers(ours["samples"], theirs["samples"], TASKS)
    # arc_easy's four choices per document; gsm8k's texts, logged once per filter (two)
    assert compared.requests == LIMIT * 4 + 2 * LIMIT
    assert_same_metrics(ours["results"], theirs["results"], TASKS, rel=0)
    # The prompts went through the template: a system turn, the two examples as user and
    # assistant turns, the question, the assistant's header to answer after.
    (prompt, _), *_ = [s["arguments"][0] for s in theirs["samples"]["gsm8k"]]
    assert prompt.startswith(
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
    )
    assert prompt.count("<|start_header_id|>assistant<|end_header_id|>") == NUM_FEWSHOT + 1
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_the_sampled_task_samples(one_process: dict[str, Any]) -> None:
    """Its YAML's do_sample reached the decoding: its texts are not the greedy task's, from the
    same prompts (each is the same in any batch and on any number of processes: the two-process
    test below and test_each_row_samples_the_same_tokens_in_any_batch)."""
    ours = one_process["ours"]["samples"]
    prompts = [s["arguments"][0][0] for s in ours[SAMPLED]]
    assert prompts == [s["arguments"][0][0] for s in ours["gsm8k"]][: len(prompts)]
    assert responses(ours[SAMPLED]) != responses(ours["gsm8k"])


@pytest.mark.slow
def test_two_processes_score_as_hflm_and_sample_as_one_process(
    one_process: dict[str, Any], assets: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "results"
    command = [
        "fsdp_utils.evaluate", "--model", str(assets["model"]),
        "--tasks", ",".join([*TASKS, SAMPLED]), "--include_path", str(assets["user"]),
        "--apply_chat_template", "--system_instruction", SYSTEM, "--seed", str(SEED),
        "--num_fewshot", str(NUM_FEWSHOT), "--limit", str(LIMIT), "--max_length", str(MAX_LENGTH),
        "--gen_kwargs", GEN_KWARGS, "--batch_size", "3", "--log_samples", "--output_dir", str(out),
        "--cache_dir", str(assets["cache"]), "--bootstrap_iters", "0",
    ]  # fmt: skip
    run = run_script(2, "-m", command, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FSDP2 over 2 process(es)" in run.stdout
    # The log and the results file say how it was scored, under lm-eval's own keys.
    assert (
        f"scoring: with the chat template, few-shot examples as turns, system instruction "
        f"'{SYSTEM}'; the tokenizer's chat template" in run.stdout
    )
    (results_file,) = out.glob("results_*.json")
    results = json.loads(results_file.read_text())
    template = (
        json.loads((assets["model"] / "tokenizer_config.json").read_text()).get("chat_template")
        or (assets["model"] / "chat_template.jinja").read_text()
    )
    assert results["chat_template"] == template
    assert re.fullmatch("[0-9a-f]{64}", results["chat_template_sha"])
    assert results["fewshot_as_multiturn"] is True
    assert results["system_instruction"] == SYSTEM
    assert results["config"]["torch_seed"] == SEED and results["config"]["fewshot_seed"] == SEED
    samples = {
        task: [json.loads(line) for line in next(out.glob(f"samples_{task}_[0-9]*.jsonl")).open()]
        for task in [*TASKS, SAMPLED]
    }
    theirs = one_process["hflm"]
    assert_same_answers(samples, theirs["samples"], TASKS)
    assert_same_metrics(results["results"], theirs["results"], TASKS, rel=0)
    alone = one_process["ours"]["samples"][SAMPLED]
    assert responses(samples[SAMPLED]) == responses(alone)


# --- sampling ---------------------------------------------------------------------------------


def test_sampling_filters_the_logits_as_transformers_does() -> None:
    """Temperature, then top-k, then top-p: the probabilities transformers' own warpers leave."""
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from fsdp_utils.parallel.generate import Sampling

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.8, 10, 0.5)]:
        ours = Sampling(temperature, top_k=top_k, top_p=top_p).probabilities(logits)
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        theirs = scores.softmax(dim=-1).double()
        assert torch.equal(ours > 0, theirs > 0), (temperature, top_k, top_p)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="temperature above 0"):
        Sampling(0.0)


def test_each_row_samples_the_same_tokens_in_any_batch(assets: dict[str, Path]) -> None:
    """A row's tokens depend on its seed alone: the same alone, reversed, or beside others,
    others from another seed; top_k=1 is greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.parallel.generate import Sampling, continue_prompts, row_seed

    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    prompts = [tokenizer(t)["input_ids"] for t in ["kalo mi", "ne ru sa ti vo ze", "the"]]
    seeds = [row_seed(SEED, "task", doc, 0, 0) for doc in range(len(prompts))]

    def run(rows: list[int], sampling: Sampling | None) -> dict[int, list[int]]:
        out = continue_prompts(
            model, [prompts[r] for r in rows], pad_token_id=tokenizer.pad_token_id,
            eos_token_id=-1, max_new_tokens=12, is_done=lambda _b, _t: False,
            device=torch.device("cpu"), sampling=sampling, seeds=[seeds[r] for r in rows],
        )  # fmt: skip
        return {r: g.tokens for r, g in zip(rows, out, strict=True)}

    sampling = Sampling(1.0, top_k=50, top_p=0.95)
    together = run([0, 1, 2], sampling)
    assert run([2, 1, 0], sampling) == together
    assert {r: run([r], sampling)[r] for r in range(3)} == together
    assert run([0, 1, 2], Sampling(1.0, top_k=1)) == run([0, 1, 2], None) != together
    seeds[:] = [row_seed(SEED + 1, "task", doc, 0, 0) for doc in range(len(prompts))]
    assert run([0, 1, 2], sampling) != together  # another seed, other tokens


# --- mistakes and comparisons ----------------------------------------------------------------


def test_a_model_without_a_chat_template_is_refused_with_the_fix(
    assets: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fsdp_utils.synthetic import save_chat_model

    plain = save_chat_model(tmp_path / "plain", "plain")
    code = evaluate_in_process(
        monkeypatch, "--model", str(plain), "--tasks", "arc_easy", "--apply_chat_template",
        "--cache_dir", str(assets["cache"]), "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--apply_chat_template: the tokenizer saved with the model ({plain}) has no chat" in err
    assert "Score it as plain text (without --apply_chat_template)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_compare_refuses_results_scored_another_way(
    assets: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before the model loads: the base was scored as plain text (its file has lm-eval's keys
    empty, or none: an older file), this evaluation with the template."""
    from fsdp_utils.lm_harness.compare import check_same_way
    from fsdp_utils.lm_harness.scoring import ScoredWay, Scoring
    from fsdp_utils.plot import main as plot_main

    plain = {"results": {"arc_easy": {"acc,none": 0.5}}}
    chat = Scoring.resolve(apply_chat_template=True, system_instruction=SYSTEM)
    templated = plain | chat.record("{{ messages }}")
    (tmp_path / "base.json").write_text(json.dumps(plain))
    code = evaluate_in_process(
        monkeypatch, "--model", str(assets["model"]), "--tasks", "arc_easy",
        "--apply_chat_template", "--system_instruction", SYSTEM,
        "--compare", str(tmp_path / "base.json"), "--cache_dir", str(assets["cache"]),
    )  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert "the two results were scored different ways" in err
    assert (
        "the base as plain text (no chat template), this evaluation with the chat template, " in err
    )
    assert (
        f"rerun the base with --apply_chat_template --fewshot_as_multiturn --system_instruction "
        f"'{SYSTEM}', or score this model as the base was, without --apply_chat_template." in err
    )
    # The same way is accepted, whichever template each model has; a different system
    # instruction, or examples in one message instead of turns, is another way.
    check_same_way(templated | {"chat_template": "other"}, chat.way, base_name="b")
    with pytest.raises(ValueError, match="system instruction 'be terse'"):
        check_same_way(
            templated
            | Scoring.resolve(apply_chat_template=True, system_instruction="be terse").record("t"),
            chat.way,
            base_name="b",
        )
    single = Scoring.resolve(apply_chat_template=True, fewshot_as_multiturn=False)
    assert single.way.describe() == "with the chat template, few-shot examples in one user message"
    assert ScoredWay.of(plain) == Scoring.resolve().way
    # The drawn comparison refuses them too.
    (tmp_path / "chat.json").write_text(json.dumps(templated))
    argv = [
        "--compare",
        str(tmp_path / "base.json"),
        str(tmp_path / "chat.json"),
        "-o",
        str(tmp_path / "c.png"),
    ]
    assert plot_main(argv) == 2
    assert "scored different ways" in capsys.readouterr().err


def test_lm_evals_option_rules() -> None:
    """lm-eval's readings: few-shot as turns follows the template unless said, and needs it;
    --seed one number or four; --gen_kwargs key=value pairs the generation path can honour."""
    from fsdp_utils.lm_harness.scoring import Scoring, parse_seed

    assert Scoring.resolve(apply_chat_template=True).fewshot_as_multiturn is True
    assert Scoring.resolve(apply_chat_template="false").apply_chat_template is False
    assert Scoring.resolve(apply_chat_template="tool_use").template_name == "tool_use"
    assert Scoring.resolve().fewshot_as_multiturn is False
    with pytest.raises(ValueError, match="add --apply_chat_template"):
        Scoring.resolve(fewshot_as_multiturn=True)
    assert parse_seed("42") == (42, 42, 42, 42)
    assert parse_seed("1,2,3") == (1, 2, 3, 1234)
    assert parse_seed("0,None,8,52") == (0, None, 8, 52)
    with pytest.raises(ValueError, match="--seed x"):
        parse_seed("x")
    scoring = Scoring.resolve(gen_kwargs="do_sample=True,temperature=0.7,until=['\\n\\n']")
    assert scoring.gen_kwargs == {"do_sample": True, "temperature": 0.7, "until": ["\n\n"]}
    with pytest.raises(ValueError, match="num_beams=4: beam search is not done here"):
        Scoring.resolve(gen_kwargs="num_beams=4")
    with pytest.raises(ValueError, match="repetition_penalty cannot be honoured"):
        Scoring.resolve(gen_kwargs="repetition_penalty=1.2")
    with pytest.raises(ValueError, match="needs a temperature above 0"):
        Scoring.resolve(gen_kwargs="do_sample=True")


def test_the_training_options_read_as_lm_evals(tmp_path: Path) -> None:
    """--eval_apply_chat_template [NAME] (an optional value, false turning the chat-data
    default off), --eval_fewshot_as_multiturn [BOOL], and a YAML's true/false; each needs
    --eval_tasks. Unset, the template follows the run's data."""
    from fsdp_utils.config.parse import parse_config
    from fsdp_utils.lm_harness.training import training_scoring

    def config(*argv: str) -> Any:
        return parse_config(["--eval_tasks", "arc_easy", *argv])[0]

    assert config("--eval_apply_chat_template").eval_apply_chat_template is True
    assert config("--eval_apply_chat_template", "false").eval_apply_chat_template is False
    assert config("--eval_apply_chat_template", "tool_use").eval_apply_chat_template == "tool_use"
    off = config("--eval_apply_chat_template", "--eval_fewshot_as_multiturn", "false")
    assert off.eval_fewshot_as_multiturn is False
    yaml = tmp_path / "train.yaml"
    yaml.write_text("eval_tasks: arc_easy\neval_apply_chat_template: true\neval_seed: 7\n")
    from_file = parse_config(["--config", str(yaml)])[0]
    assert (from_file.eval_apply_chat_template, from_file.eval_seed) == (True, 7)
    with pytest.raises(ValueError, match="--eval_system_instruction says how --eval_tasks"):
        parse_config(["--eval_system_instruction", "hi"])

    chat, why = training_scoring(config(), chat_data="the chat template of org/m")
    assert (chat.apply_chat_template, chat.fewshot_as_multiturn) == (True, True)
    assert "the default for a run on chat data, rendered with the chat template of org/m" in why
    plain, why = training_scoring(config(), chat_data=None)
    assert plain.apply_chat_template is False and "not chat" in why
    refused, why = training_scoring(
        config("--eval_apply_chat_template", "false"), chat_data="the chat template of org/m"
    )
    assert refused.apply_chat_template is False and why == " (--eval_apply_chat_template false)"
    seeded, _ = training_scoring(config("--eval_seed", "9"), chat_data=None)
    assert seeded.seeds == (9, 9, 9, 9)
