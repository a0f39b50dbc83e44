"""Chat fine-tuning for real: 2 gloo processes, a tiny model without a chat template of its own
trained with --chat_template FILE on conversations whose prompts are random and whose answer
is always the same. The loss on the answers falls near zero; the exported model, asked a new
question through its chat template, gives the answer and stops at the end-of-turn token. With
--train_on_prompt the random prompts are trained too, and the loss stays high. The step count
comes from --num_epochs, and a resumed run keeps it. The benchmarks at the end of the run
(--eval_tasks) score through the chat template the final model carries, by default on chat
data, and say so."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from fsdp_utils.synthetic import CHATML_TEMPLATE, random_conversations, save_chat_model
from tests.chat_helpers import write_jsonl
from tests.lm_eval_data import cache_task_data
from tests.train_helpers import check_ok, read_metrics, run_finetune, tiny_args

pytestmark = pytest.mark.slow

ANSWER = "kalo mine ti vo"
EPOCHS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chat_e2e")
    template = root / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    rows = [{"messages": c} for c in random_conversations(320, seed=1, words=(3, 8), answer=ANSWER)]
    question = "vozeti pa gi nothing like the training prompts"
    samples = [
        {"messages": [{"role": "user", "content": question}]},  # through the chat template
        {"prompt": f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"},  # as text
    ]
    cache_task_data(root / "hub", ["arc_easy"])  # for the benchmarks at the end
    return {
        "root": root,
        "model": save_chat_model(root / "model", "plain"),  # no chat template of its own
        "data": write_jsonl(root / "chat.jsonl", rows),
        "template": template,
        "samples": write_jsonl(root / "samples.jsonl", samples),
    }


def _args(setup: dict[str, Any], name: str, **overrides: Any) -> list[str]:
    assets = {"model": setup["model"], "data": setup["data"]}
    root = setup["root"]
    options = {
        "chat_template": setup["template"], "num_epochs": EPOCHS, "max_training_steps": None,
        "learning_rate": 1e-2, "eval_examples": 32, "eval_batches": 4, "log_every": 4,
        **overrides,
    }  # fmt: skip
    return tiny_args(assets, root / name, root / "prepared", **options)


@pytest.fixture(scope="module")
def answers_run(setup) -> dict[str, Any]:
    """Two legs: stopped after 10 steps, then resumed to the end (where the final evaluation
    answers --sample_prompts, and the final model is scored on arc_easy)."""
    samples = {"sample_prompts": setup["samples"], "sample_max_new_tokens": 12}
    samples |= {"eval_tasks": "arc_easy", "eval_limit": 4, "cache_dir": setup["root"] / "hub"}
    first = run_finetune(2, _args(setup, "answers", stop_after_steps=10, **samples))
    check_ok(first)
    second = run_finetune(2, _args(setup, "answers", **samples))
    check_ok(second)
    out = setup["root"] / "answers"
    return {"legs": (first, second), "out": out, "train": read_metrics(out)}


@pytest.fixture(scope="module")
def prompt_run(setup) -> dict[str, Any]:
    result = run_finetune(2, _args(setup, "prompt", train_on_prompt=True))
    check_ok(result)
    return {"train": read_metrics(setup["root"] / "prompt")}


def _epoch_steps(output: str) -> int:
    match = re.search(rf"epochs: {EPOCHS} x (\d+) steps \(.*\) = (\d+) steps", output)
    assert match, output
    per_epoch, total = int(match[1]), int(match[2])
    assert total == EPOCHS * per_epoch
    return total


def test_the_loss_on_the_answers_falls_near_zero(answers_run):
    final = answers_run["train"][-1]
    assert final["loss"] < 0.05, [r["loss"] for r in answers_run["train"]]
    first, _second = answers_run["legs"]
    assert (
        "data: chat: --chat_template" in first.stdout
        and "end-of-turn token <|im_end|>" in first.stdout
    )


def test_num_epochs_sets_the_steps_and_a_resumed_run_keeps_them(answers_run):
    first, second = answers_run["legs"]
    steps = _epoch_steps(first.stdout)
    assert _epoch_steps(second.stdout) == steps
    assert "resumed from step 10" in second.stdout
    assert answers_run["train"][-1]["step"] == steps
    config = json.loads((answers_run["out"] / "config.json").read_text())["config"]
    assert config["max_training_steps"] == steps and config["num_epochs"] == EPOCHS


def test_the_exported_model_answers_and_stops_at_the_end_of_turn(answers_run, setup):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = answers_run["out"] / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template == setup["template"].read_text()
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    question = [{"role": "user", "content": "vozeti pa gi nothing like the training prompts"}]
    inputs = tokenizer.apply_chat_template(
        question, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The answer, then <|im_end|>, where generation stops by itself (generation_config.json).
    assert new == [*tokenizer(ANSWER, add_special_tokens=False)["input_ids"], im_end]


def test_sample_prompts_are_answered_at_the_evaluation_under_fsdp(answers_run):
    """Both ranks decode through the sharded model; rank 0 writes samples.jsonl and the log:
    the trained answer, ended by the end-of-turn token, for chat messages and for text."""
    records = [
        json.loads(line) for line in (answers_run["out"] / "samples.jsonl").read_text().splitlines()
    ]
    final_step = answers_run["train"][-1]["step"]
    assert [(r["step"], r["index"]) for r in records] == [(final_step, 1), (final_step, 2)]
    for record in records:
        assert record["answer"].strip() == ANSWER and record["stopped"], record
    assert records[0]["prompt_text"] == records[1]["prompt_text"]  # the template's rendering
    _first, second = answers_run["legs"]
    assert f"samples step {final_step}:" in second.stdout
    assert f"-> '{ANSWER}' (stopped)" in second.stdout


def test_with_train_on_prompt_the_loss_stays_high(prompt_run, answers_run):
    final = prompt_run["train"][-1]
    assert final["step"] == answers_run["train"][-1]["step"]
    assert final["loss"] > 1.0, [r["loss"] for r in prompt_run["train"]]


def test_the_benchmarks_at_the_end_score_through_the_chat_template(answers_run, setup):
    """A run on chat data is scored with the template its final model carries (here only
    through --chat_template: the model has none of its own), as lm-eval's HFLM scores that
    final model with apply_chat_template; the log and the results file say so."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.lm_harness.tasks import offline_tasks, task_manager

    _first, second = answers_run["legs"]
    assert (
        "scoring: with the chat template, few-shot examples as turns (the default for a run "
        f"on chat data, rendered with --chat_template {setup['template']}; "
        "--eval_apply_chat_template false scores plain text)" in second.stdout
    )
    (results_file,) = (answers_run["out"] / "lm_eval").glob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["chat_template"] == setup["template"].read_text()
    assert results["fewshot_as_multiturn"] is True
    assert results["fsdp_utils"]["scoring"].startswith("with the chat template")
    ours = results["results"]["arc_easy"]
    assert f"arc_easy: acc {ours['acc,none']:.4f}" in second.stdout  # the end-of-run summary

    final = answers_run["out"] / "final"
    include = setup["root"] / "reference-tasks"
    leaves = offline_tasks(["arc_easy"], setup["root"] / "hub", include)
    hflm = HFLM(
        pretrained=AutoModelForCausalLM.from_pretrained(final, dtype="float32").eval(),
        tokenizer=AutoTokenizer.from_pretrained(final), batch_size=4, device="cpu",
    )  # fmt: skip
    theirs = simple_evaluate(
        hflm, tasks=["arc_easy"], limit=4, bootstrap_iters=100_000, apply_chat_template=True,
        task_manager=task_manager(["arc_easy"], leaves, include),
    )["results"]["arc_easy"]  # fmt: skip
    assert (ours["acc,none"], ours["acc_norm,none"]) == (
        theirs["acc,none"],
        theirs["acc_norm,none"],
    )
