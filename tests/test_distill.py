"""Distillation (fsdp_utils/methods/distill/): the losses against TRL's formula and a direct
computation on full logits, in chunks and not, from a cached top K and live; then real runs
(2 processes, FSDP2, gloo): live against cached, 1 against 2 processes, a resume, a teacher
cache stopped half-way, a student that learns the teacher's pattern better than SFT does, and
the user's mistakes (exit 2, one paragraph).

One launch of 2 processes (`runs`, through tests/trainer_runs.py) and one single process feed
the end-to-end checks.
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_utils.data.blocks import IGNORE_INDEX
from fsdp_utils.methods.distill.loss import (
    TERMS,
    DistillSettings,
    cached_terms,
    divergence,
    live_terms,
    teacher_top_k,
)
from fsdp_utils.train.loss import Targets, chunked_over_targets

# --- TRL's generalized JSD, copied as the independent reference ------------------------------
# From https://github.com/huggingface/trl/blob/v1.9.0/trl/experimental/gkd/gkd_trainer.py
# (commit a785283c0ea7395092fc5bd60fc38e7f4d972003, lines 239-323: the static method
# GKDTrainer.generalized_jsd_loss; unchanged on main as of July 2026), its arithmetic unchanged,
# the reductions but "sum" left out. TRL itself is not a test dependency: its datasets>=4.7
# cannot install beside the datasets floor (3.0) that `make test-floor` tests.


def trl_generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack(
                [student_log_probs + torch.log1p(-beta_t), teacher_log_probs + torch.log(beta_t)]
            ),
            dim=0,
        )
        kl_teacher = F.kl_div(
            mixture_log_probs, teacher_log_probs, reduction="none", log_target=True
        )
        kl_student = F.kl_div(
            mixture_log_probs, student_log_probs, reduction="none", log_target=True
        )
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    return jsd.sum()  # reduction="sum"


def _direct(
    student: torch.Tensor, teacher: torch.Tensor, loss: str, beta: float, t: float
) -> torch.Tensor:
    """[tokens] the divergence written out from the softmaxes, no library KL."""
    q, p = torch.softmax(student / t, -1), torch.softmax(teacher / t, -1)
    if loss == "forward_kl":
        return (p * (p.log() - q.log())).sum(-1)
    if loss == "reverse_kl":
        return (q * (q.log() - p.log())).sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (p.log() - m.log())).sum(-1) + (1 - beta) * (q * (q.log() - m.log())).sum(-1)


LOSSES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)]


@pytest.mark.parametrize(("loss", "beta"), LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_each_divergence_equals_trls_and_the_direct_formula(loss, beta, temperature):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 50, generator=gen, dtype=torch.float64) * 2
    teacher = torch.randn(3, 7, 50, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    settings = DistillSettings(loss, beta, temperature)
    expected = trl_generalized_jsd_loss(student, teacher, labels, settings.trl_beta, temperature)
    mask = labels != IGNORE_INDEX
    s_log = torch.log_softmax(student[mask] / temperature, -1)
    t_log = torch.log_softmax(teacher[mask] / temperature, -1)
    ours = divergence(s_log, t_log, loss, beta)
    assert ours.sum().item() == pytest.approx(expected.item(), rel=1e-12)
    direct = _direct(student[mask], teacher[mask], loss, beta, temperature)
    torch.testing.assert_close(ours, direct, rtol=1e-10, atol=1e-12)
    assert (ours > 0).all()


class _Heads:
    """A student and a teacher output layer over a shared vocabulary of 40 (the teacher's
    wider: 44 rows, as Qwen2.5's 7B beside its 0.5B), and hidden states of 13 targets."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.student = nn.Linear(8, 40, bias=False).double()
        self.teacher = nn.Linear(12, 44, bias=False).double()
        with torch.no_grad():
            self.student.weight.copy_(torch.randn(40, 8, generator=gen, dtype=torch.float64))
            self.teacher.weight.copy_(2 * torch.randn(44, 12, generator=gen, dtype=torch.float64))
        self.teacher.requires_grad_(False)  # frozen, as the run's teacher
        self.hidden = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        self.teacher_hidden = torch.randn(13, 12, generator=gen, dtype=torch.float64)
        self.tokens = torch.randint(0, 40, (13,), generator=gen)


def _full_logits_terms(h: _Heads, settings: DistillSettings) -> torch.Tensor:
    """[13, TERMS] straight from the full logits: the test's own unchunked computation."""
    logits = h.student(h.hidden)
    teacher = h.teacher(h.teacher_hidden)[:, :40]
    ce = F.cross_entropy(logits, h.tokens, reduction="none")
    div = _direct(logits, teacher, settings.loss, settings.beta, settings.temperature)
    kl = _direct(logits, teacher, "forward_kl", 0.5, settings.temperature)
    agree = (logits.argmax(-1) == teacher.argmax(-1)).double()
    return torch.stack([ce, div, kl, agree], dim=1)


def _chunked(
    h: _Heads, compute: Any, chunk: int, per_target: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    # All 13 rows of a [1, 13, hidden] batch are targets, in order.
    targets = Targets(rows=torch.arange(13), shifted=torch.arange(13), tokens=h.tokens)
    return chunked_over_targets(
        compute, h.hidden.unsqueeze(0), targets, chunk_size=chunk, per_target=per_target
    )


@pytest.mark.parametrize(("loss", "beta"), LOSSES)
def test_chunked_live_terms_and_gradients_equal_the_full_logits(loss, beta):
    h = _Heads()
    settings = DistillSettings(loss, beta, temperature=1.5, alpha=0.3, vocab=40)
    expected = _full_logits_terms(h, settings)
    weights = torch.tensor([0.7, 0.3, 0.0, 0.0], dtype=torch.float64)
    (expected * weights).sum().backward()
    grads = (h.hidden.grad.clone(), h.student.weight.grad.clone())
    compute = functools.partial(live_terms, settings, (h.student, None), (h.teacher, None))
    for chunk in (1, 4, 13):  # checkpointed chunks recomputed in backward, and one chunk
        h.hidden.grad = h.student.weight.grad = None
        terms = _chunked(h, compute, chunk, (h.teacher_hidden,))
        torch.testing.assert_close(terms, expected, rtol=1e-10, atol=1e-12)
        (terms * weights).sum().backward()
        torch.testing.assert_close(h.hidden.grad, grads[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h.student.weight.grad, grads[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("loss", "beta"), LOSSES)
def test_a_cache_of_the_whole_vocabulary_equals_the_live_teacher(loss, beta):
    """K = vocabulary: the cached terms (and gradients) are the live ones; a smaller K is exact
    over its tokens and never above the whole vocabulary's divergence (data processing)."""
    h = _Heads()
    settings = DistillSettings(loss, beta, temperature=1.5, alpha=0.3, vocab=40)
    live = functools.partial(live_terms, settings, (h.student, None), (h.teacher, None))
    expected = _chunked(h, live, 5, (h.teacher_hidden,))
    expected[:, :2].sum().backward()
    grad = h.hidden.grad.clone()
    h.hidden.grad = None
    cached = functools.partial(cached_terms, settings, (h.student, None))
    for k in (40, 6):
        entries = teacher_top_k((h.teacher, None), h.teacher_hidden, k=k, temperature=1.5, vocab=40)
        terms = _chunked(h, cached, 5, entries)
        if k == 40:
            torch.testing.assert_close(terms, expected, rtol=1e-9, atol=1e-9)
            terms[:, :2].sum().backward()
            torch.testing.assert_close(h.hidden.grad, grad, rtol=1e-9, atol=1e-9)
        else:
            assert (terms[:, 1] <= expected[:, 1] + 1e-12).all()
            assert (terms[:, 1] < expected[:, 1] - 1e-6).any()
            torch.testing.assert_close(terms[:, 0], expected[:, 0])  # the labels' CE
            _, top, rest = entries
            assert (top[:, :-1] >= top[:, 1:]).all()  # most likely first
            total = torch.logsumexp(torch.cat([top, rest[:, None]], 1), dim=1)
            torch.testing.assert_close(total, torch.zeros(13, dtype=torch.float64))


def test_the_terms_are_named_in_the_order_the_chunks_return_them():
    assert TERMS == ("ce", "divergence", "teacher_kl", "top1_agreement")


# --- real runs ----------------------------------------------------------------------------------

STEPS = 10
STUDENT = {
    "method": "distill", "max_examples": 60, "eval_examples": 20, "max_training_steps": STEPS,
    "log_every": 1, "eval_every": STEPS, "eval_batches": 8, "learning_rate": 3e-3,
}  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """Chess games with their BPE tokenizer (512 tokens), the student (2 layers of 64), a
    teacher to train first (3 layers of 96) and one to keep in 4 bits (2 layers of 256), all
    of the one tokenizer."""
    from transformers import AutoTokenizer

    from fsdp_utils.synthetic import (
        build_demo_assets,
        chat_tokenizer,
        random_words,
        save_tiny_model,
    )
    from tests.chat_helpers import write_jsonl

    root = tmp_path_factory.mktemp("distill")
    demo = build_demo_assets(root / "assets", num_games=200, num_shards=1)
    tokenizer = AutoTokenizer.from_pretrained(demo["model"])
    teacher = save_tiny_model(
        root / "teacher_init", tokenizer, hidden_size=96, num_layers=3, seed=1
    )
    nf4 = save_tiny_model(root / "teacher_nf4", tokenizer, hidden_size=256, num_layers=2, seed=2)
    # Prompts and answers for the student's own samples (--lmbda), in a chat tokenizer
    chat = chat_tokenizer("chatml")
    rng = random.Random(0)
    rows = [
        {
            "prompt": random_words(rng, rng.randint(2, 6)),
            "completion": " " + random_words(rng, rng.randint(1, 5)),
        }
        for _ in range(120)
    ]
    return {**demo, "root": root, "teacher_init": teacher, "teacher_nf4": nf4,
            "teacher": root / "teacher" / "final", "cache": root / "teacher_cache",
            "chat_student": save_tiny_model(root / "chat_student", chat, seed=0),
            "chat_teacher": save_tiny_model(root / "chat_teacher", chat, hidden_size=96, seed=1),
            "prompts": write_jsonl(root / "prompts.jsonl", rows)}  # fmt: skip


def _args(assets: dict[str, Path], out: Path, **overrides: Any) -> list[str]:
    from tests.train_helpers import tiny_args

    options: dict[str, Any] = {**STUDENT, "teacher": assets.get("teacher"), **overrides}
    if options["method"] != "distill":
        options["teacher"] = None
    return tiny_args(assets, out, assets["root"] / "data_cache", **options)


def _trainer_runs(nproc: int, runs: list[dict[str, Any]], root: Path) -> str:
    """tests/trainer_runs.py on `nproc` processes forked as torchrun's workers (tests/prefork.py:
    the launcher is not the point here)."""
    from tests.train_helpers import check_ok, run_script

    root.mkdir(parents=True, exist_ok=True)
    (root / "runs.json").write_text(json.dumps(runs, default=str))
    result = run_script(nproc, "tests/trainer_runs.py", [str(root / "runs.json")], timeout=900)
    check_ok(result)
    return result.stdout


@pytest.fixture(scope="module")
def runs(assets) -> dict[str, Any]:
    """One launch of 2 processes: the teacher's own fine-tune (all 200 games, 25 steps); on
    60 of them, a student distilled from it live and one fine-tuned (SFT) the same steps; the
    same distillation from a cache of the teacher's whole distribution (K = vocabulary) in three
    legs (the cache pass stopped after 3 batches, training stopped after 5 steps, then the
    rest); two steps with the teacher in 4 bits."""
    root = assets["root"]
    teacher = {"model": assets["teacher_init"], "data": assets["data"], "root": root}
    cached = _args(assets, root / "cached", teacher_cache=assets["cache"], teacher_top_k=512)
    split = _on_policy_args(assets, root / "on_policy_split")
    runs = [
        {"args": _args(teacher, root / "teacher", method="sft", max_examples=None,
                       max_training_steps=25, learning_rate=8e-3, eval_every=0)},
        {"args": _args(assets, root / "live")},
        {"args": _args(assets, root / "sft", method="sft")},
        {"args": cached, "stop_after_teacher_cache_batches": 3},
        {"args": [*cached, "--stop_after_steps", "5"]},
        {"args": cached},
        {"args": _args(assets, root / "nf4", teacher=assets["teacher_nf4"],
                       teacher_quantize="nf4", max_training_steps=2, eval_every=0)},
        {"args": _on_policy_args(assets, root / "on_policy")},
        {"args": [*split, "--stop_after_steps", "3"]},
        {"args": split},
    ]  # fmt: skip
    stdout = _trainer_runs(2, runs, root / "w2")
    names = ("live", "sft", "cached", "nf4", "on_policy", "on_policy_split")
    return {"stdout": stdout, **{name: root / name for name in names}}


def _on_policy_args(assets: dict[str, Path], out: Path, **overrides: Any) -> list[str]:
    """Half the steps on the student's own samples: prompt/completion rows, one per block."""
    chat = {"model": assets["chat_student"], "data": assets["prompts"], "root": assets["root"]}
    return _args(
        chat, out, teacher=assets["chat_teacher"], lmbda=0.5, no_packing=True,
        max_seq_length=48, distill_max_new_tokens=12, max_examples=None, eval_every=0,
        max_training_steps=6, **overrides,
    )  # fmt: skip


def _losses(folder: Path) -> list[float]:
    from tests.train_helpers import read_metrics

    return [r["loss"] for r in read_metrics(folder)]


@pytest.mark.slow
def test_a_cache_of_the_whole_vocabulary_stopped_and_resumed_trains_as_the_live_teacher(runs):
    from tests.train_helpers import read_metrics

    live, cached = read_metrics(runs["live"]), read_metrics(runs["cached"])
    assert [r["step"] for r in cached] == list(range(1, STEPS + 1))
    assert [r["batch_id"] for r in cached] == [r["batch_id"] for r in live]
    for name in ("loss", "distill/ce", "distill/teacher_kl", "distill/top1_agreement"):
        np.testing.assert_allclose(
            [r[name] for r in cached], [r[name] for r in live], rtol=1e-5, atol=1e-6, err_msg=name
        )
    assert [r["step"] for r in read_metrics(runs["cached"], "resumed")] == [5]
    out = runs["stdout"]
    assert "distill: the teacher cache stopped at 12 of " in out  # 3 batches x 2 ranks x 2
    assert "stopping before the first step: stop file during --method distill's work" in out
    assert "blocks kept, " in out and "distill: teacher cache complete in" in out
    meta = json.loads((runs["cached"].parent / "teacher_cache" / "meta.json").read_text())
    assert meta["complete"] and meta["top_k"] == 512
    # A cached teacher's KL is over its top K and the rest: a lower bound, said where printed.
    assert all(r["distill/teacher_top_k"] == 512 for r in cached)
    assert not any("distill/teacher_top_k" in r for r in live)
    assert " (top-512 lower bound) ce " in out


def test_a_cached_teachers_kl_is_printed_as_its_top_k_bound():
    from fsdp_utils.metrics.logger import format_eval

    record = {"eval_loss": 2.5, "eval_distill/teacher_kl": 0.0053, "eval_distill/ce": 2.9,
              "eval_distill/top1_agreement": 0.5, "eval_tokens": 1000}  # fmt: skip
    assert "kl 0.0053 ce 2.9000" in format_eval(record)  # live: the whole vocabulary's
    bounded = format_eval({**record, "eval_distill/teacher_top_k": 32})
    assert "kl 0.0053 (top-32 lower bound) ce 2.9000" in bounded


@pytest.mark.slow
def test_one_process_gives_the_losses_and_samples_of_two(runs, assets):
    """The live teacher's run, and the on-policy run (the same steps on the student's samples,
    and the same samples: their losses are the teacher's verdicts on them), on 1 process."""
    from tests.train_helpers import read_metrics

    root = assets["root"]
    one = [
        {"args": _args(assets, root / "live_1", stop_after_steps=4)},
        {"args": _on_policy_args(assets, root / "on_policy_1")},
    ]
    _trainer_runs(1, one, root / "w1")
    np.testing.assert_allclose(_losses(root / "live_1"), _losses(runs["live"])[:4], rtol=1e-5)
    flags = [r["distill/on_policy"] for r in read_metrics(root / "on_policy_1")]
    assert flags == [r["distill/on_policy"] for r in read_metrics(runs["on_policy"])]
    np.testing.assert_allclose(_losses(root / "on_policy_1"), _losses(runs["on_policy"]), rtol=1e-5)


@pytest.mark.slow
def test_on_policy_steps_are_the_lmbda_share_score_the_samples_and_resume_exactly(runs):
    """lmbda 0.5: some steps on the data, some on the student's samples, the same in a run
    stopped at step 3 and resumed; a sampled step's loss is the divergence alone."""
    from tests.train_helpers import read_metrics

    whole, split = read_metrics(runs["on_policy"]), read_metrics(runs["on_policy_split"])
    flags = [r["distill/on_policy"] for r in whole]
    assert 0 < sum(flags) < len(flags), flags
    assert flags == [r["distill/on_policy"] for r in split]
    np.testing.assert_allclose([r["loss"] for r in split], [r["loss"] for r in whole], rtol=1e-5)
    for record in whole:
        if record["distill/on_policy"]:
            assert record["loss"] == pytest.approx(record["distill/divergence"], rel=1e-6)
        else:  # alpha 0.5 of each
            mixed = 0.5 * (record["distill/divergence"] + record["distill/ce"])
            assert record["loss"] == pytest.approx(mixed, rel=1e-6)
    assert "on-policy (--lmbda 0.5)" in runs["stdout"]


def _held_out_kl(assets: dict[str, Path], student: Path, run: Path) -> float:
    """KL(teacher || student) per target token on the held-out blocks of `run`, from the two
    models' full logits through transformers alone."""
    from transformers import AutoModelForCausalLM

    from fsdp_utils.data.prepare import PreparedData

    config = json.loads((run / "config.json").read_text())
    blocks = PreparedData.load(Path(config["resolved"]["prepared_data"])).split("eval")
    batch = blocks.batch(np.arange(len(blocks)))
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in
              (assets["teacher"], student)]  # fmt: skip
    with torch.no_grad():
        t_log, s_log = (
            torch.log_softmax(m(input_ids=batch["input_ids"]).logits[:, :-1], -1) for m in models
        )
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    kl = (t_log.exp() * (t_log - s_log)).sum(-1)
    return float(kl[mask].mean())


@pytest.mark.slow
def test_the_distilled_student_is_closer_to_the_teacher_than_sft_on_the_same_data(runs, assets):
    """The teacher learnt the games' patterns from 200 of them; the students see 40, which show
    them only weakly. On the held-out games, the distilled student's KL to the teacher is below
    the fine-tuned one's (computed here from the exported models' full logits), and the run's own
    evaluation says the same KL."""
    from tests.train_helpers import read_metrics

    distilled = _held_out_kl(assets, runs["live"] / "final", runs["live"])
    fine_tuned = _held_out_kl(assets, runs["sft"] / "final", runs["live"])
    base = _held_out_kl(assets, assets["model"], runs["live"])
    assert distilled < 0.8 * fine_tuned < 0.8 * base, (distilled, fine_tuned, base)
    evaluated = read_metrics(runs["live"], "eval")[-1]
    assert evaluated["eval_distill/teacher_kl"] == pytest.approx(distilled, rel=0.05)
    train = read_metrics(runs["live"])
    assert set(TERMS) <= {name.removeprefix("distill/") for name in train[-1]}
    assert train[-1]["distill/teacher_kl"] < train[0]["distill/teacher_kl"]
    # The run's plot draws the terms as logged, train and eval split.
    from fsdp_utils.metrics.plot import RunCurves, plot_runs

    _, drawn = plot_runs([RunCurves.load(runs["live"], "live")])
    lines = {d.series: d.points() for d in drawn}
    for name in ("distill/teacher_kl", "distill/top1_agreement"):
        assert lines[name] == [(r["step"], r[name]) for r in train]
        assert lines[f"eval_{name}"] == [(evaluated["step"], evaluated[f"eval_{name}"])]


@pytest.mark.slow
def test_a_4_bit_teacher_distils(runs):
    from tests.train_helpers import read_metrics

    line = next(x for x in runs["stdout"].splitlines() if "teacher_nf4: llama" in x)
    assert "; NF4 base: 14 linear weights of the decoder layers" in line, line
    records = read_metrics(runs["nf4"])
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)


# --- the user's mistakes: exit 2, one paragraph -----------------------------------------------


def _exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from fsdp_utils import cli

    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err
    message = err.strip().removeprefix("error: ")
    assert "\n\n" not in message, message
    return message


def test_a_teacher_of_another_vocabulary_is_refused_by_name(assets, tmp_path, capsys):
    from fsdp_utils.synthetic import save_chat_model

    other = save_chat_model(tmp_path / "chat_teacher", "chatml")
    argv = [*_args(assets, tmp_path / "run", teacher=other), "--preflight", "--world_size", "1"]
    code, err = _exit_code(argv, capsys)
    assert code == 2
    message = _one_paragraph(err)
    assert (
        f"The teacher {other} has another vocabulary than the student {assets['model']}" in message
    )
    assert "choose a teacher of the student's family" in message


def test_a_missing_cache_without_a_teacher_names_the_teacher_s_job(assets, tmp_path, capsys):
    argv = _args(assets, tmp_path / "run", teacher=None, teacher_cache=tmp_path / "empty")
    code, err = _exit_code([*argv, "--preflight", "--world_size", "1"], capsys)
    assert code == 2
    message = _one_paragraph(err)
    assert f"--teacher_cache {tmp_path / 'empty'} holds no teacher cache" in message
    assert "--teacher_cache_only" in message


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"teacher": "student"}, "was written by another teacher"),
        ({"max_seq_length": 32}, "holds the teacher's log-probabilities of another data set"),
        ({"distill_temperature": 2.0}, "holds log-probabilities at --distill_temperature 1"),
    ],
)
def test_a_cache_of_another_teacher_data_set_or_temperature_is_refused(
    runs, assets, tmp_path, capsys, change, says
):
    """The cache the runs wrote (its teacher, its data), read by a run that differs."""
    if change.get("teacher") == "student":
        change = {"teacher": assets["model"]}
    argv = _args(assets, tmp_path / "run", teacher_cache=assets["cache"], **change)
    code, err = _exit_code(argv, capsys)
    assert code == 2
    message = _one_paragraph(err)
    assert f"--teacher_cache {assets['cache']} " in message and says in message


def test_the_planner_counts_the_teacher_and_offers_the_teacher_s_own_job(assets):
    """The teacher's shards (fp32 under --precision fp32, half on each of 2 GPUs) are planned
    as frozen parameters (bench/distill_memory.py plans the cache's runs too). Its own job is
    among the changes the planner tries for a run that does not fit."""
    from transformers import AutoConfig

    from fsdp_utils.config.parse import config_from_dict
    from fsdp_utils.methods.distill.method import Distill
    from fsdp_utils.plan import plan_memory

    def options(**more: Any) -> Any:
        base = {"model": str(assets["model"]), "max_seq_length": 64, "total_batch_size": 4,
                "batch_size_per_device": 2, "precision": "fp32", "method": "distill"}  # fmt: skip
        return config_from_dict({**base, **more})

    live = options(teacher=str(assets["teacher_init"]))
    plan = plan_memory(live, nodes=1, gpus_per_node=2, gpu_memory_bytes=None, suggest_fixes=False)
    teacher = AutoConfig.from_pretrained(assets["teacher_init"])
    params = sum(p.numel() for p in _meta_model(teacher).parameters())
    assert plan.frozen_bytes == params * 4 // 2
    fixes = dict((flags, trial) for flags, _, trial in Distill.memory_fixes(live))
    assert fixes["--teacher_cache DIR"].teacher is None
    assert fixes["--teacher_quantize nf4"].teacher_quantize == "nf4"


def _meta_model(hf_config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def test_download_models_fetches_the_teacher_with_the_run_s_config():
    from fsdp_utils.config.parse import config_from_dict
    from fsdp_utils.hub.specs import AssetSpec, specs_from_train_config

    config = config_from_dict(
        {"model": "org/small", "method": "distill", "teacher": "org/big", "teacher_revision": "v2"}
    )
    assert AssetSpec("org/big", "model", revision="v2") in specs_from_train_config(config)


def test_the_teacher_is_built_without_the_student_s_training_kernels():
    """A frozen teacher runs no backward: none of the student's checkpointing, liger-kernel,
    float8 or compile options reach its build (`teacher_build_config`)."""
    from fsdp_utils.config.train_config import TrainConfig
    from fsdp_utils.model.teacher import teacher_build_config

    student = TrainConfig(
        gradient_checkpointing=True, checkpoint_mode="op", liger_kernels=True, float8="rowwise",
        compile=True, compile_scope="model", precision="bf16-mixed",
    )  # fmt: skip
    built = teacher_build_config(student)
    assert (built.gradient_checkpointing, built.checkpoint_mode, built.liger_kernels) == (
        False, "layer", False,
    )  # fmt: skip
    assert (built.float8, built.compile, built.precision) == ("none", False, "bf16-true")
    counted = teacher_build_config(TrainConfig(checkpoint_layers=3))  # --auto's choice
    assert counted.checkpoint_layers is None
