"""The GPU validation kit's logic, on CPU: no GPU is at hand in CI (bench/gpu_check.py), and the
carried wheels' tooling (bench/device_stack.py) on wheels built here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from unittest import mock

import pytest

from tests.prefork import launch

REPO = Path(__file__).resolve().parent.parent


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kit = _load("gpu_check")
stack = _load("device_stack")


def test_shapes_have_the_sizes_they_are_named_after() -> None:
    # Count against transformers itself on meta (no memory), not against our own formula.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, low, high in [("1b", 1.0e9, 1.2e9), ("3b", 2.8e9, 3.4e9), ("8b", 7.0e9, 8.1e9)]:
        shape = kit.SHAPES[name]
        config = LlamaConfig(
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            vocab_size=shape.vocab,
            tie_word_embeddings=False,
        )
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        real = sum(p.numel() for p in model.parameters())
        assert real == shape.parameters(), name
        assert low < real < high, (name, real)


def test_the_rows_are_the_measurements_issue_43_asks_for() -> None:
    rows = {r.name: r for r in kit.ROWS}
    small = [r for r in rows.values() if r.kind == "train" and r.role == "small"]
    assert {r.seq for r in small} == {2048}
    flags = {r.name: set(r.flags) for r in small}
    assert "--gradient_checkpointing" not in flags["1b-bf16"]
    assert "--gradient_checkpointing" in flags["1b-bf16-ac"]
    assert "--cpu_offload" in flags["1b-bf16-offload"]
    assert all({"--precision", "bf16-mixed"} <= flags[n] for n in ("1b-bf16", "1b-bf16-ac"))
    lora = rows["8b-lora-4k"]
    assert (lora.role, lora.seq, "--lora" in lora.flags) == ("large", 4096, True)
    long = rows["8b-lora-32k"]
    assert (long.role, long.seq) == ("large", 32768)
    qlora = rows["8b-qlora-4k"]
    assert qlora.flags[-3:] == kit.QLORA and qlora.seq == 4096
    assert {r.kind for r in rows.values()} == {"train", "checkpoint", "masking", "evaluate", "grpo"}
    grpo = rows["1b-grpo"]  # issue 50's: GRPO on the 1B shape with G = 8
    assert grpo.role == "small" and grpo.flags[grpo.flags.index("--num_generations") + 1] == "8"
    # The checkpoint row comes before the evaluation of its export.
    names = list(rows)
    assert names.index("1b-checkpoint") < names.index("1b-evaluate")


def test_the_prepared_call_fits_its_budget_and_quick_fits_a_second_call() -> None:
    """The plan, by its estimates (the first H100 call's wall times): every row issue 43 asks
    for and GRPO's (issue 50's, never run on a GPU) within the 460 s budget (the call's
    timeout_s 550 leaves the rest to the wheels and the start); QLoRA's row (issue 40's), the
    fp16 row and the compiled row, all three measured on the first H100 call, come last and
    run only with time to spare (else a second call's --only); --quick is the second try,
    within what 15 minutes of device time leave after the first call and a second start."""
    everything = kit.select_rows(kit.ROWS)
    spare = ("8b-qlora-4k", "1b-fp16", "1b-bf16-compile")
    first = [r for r in everything if r.name not in spare]
    assert everything[-3:] == [r for r in everything if r not in first]
    assert "1b-grpo" in {r.name for r in first}
    assert kit.estimate_s(first) <= kit.DEFAULT_BUDGET_S <= 460
    quick = kit.select_rows(kit.ROWS, quick=True)
    assert {r.role for r in quick} == {"small"}  # no 8B weights to write
    assert kit.estimate_s(quick) <= 900 - 30 - 550 - 30


def test_only_selects_rows_in_order_and_names_a_typo() -> None:
    chosen = kit.select_rows(kit.ROWS, only="8b-lora-32k,1b-bf16")
    assert [r.name for r in chosen] == ["1b-bf16", "8b-lora-32k"]
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['8b-lora'\]"):
        kit.select_rows(kit.ROWS, only="8b-lora")


def test_rows_are_skipped_with_their_reason() -> None:
    rows = {r.name: r for r in kit.ROWS}
    assert kit.skip_reason(rows["1b-bf16"], device="cuda", left=100.0) is None
    assert "budget" in kit.skip_reason(rows["1b-bf16"], device="cuda", left=10.0)
    weights = kit.skip_reason(rows["8b-lora-4k"], device="cuda", left=50.0, extra_s=30.0)
    assert "about 66 s" in weights  # 36 s of row + 30 s of weights
    assert "CUDA" in kit.skip_reason(rows["1b-bf16-offload"], device="cpu", left=1e9)
    qlora = rows["8b-qlora-4k"]
    for large in ("8b", "tiny"):  # the dry run's tiny shape runs QLoRA too
        assert kit.skip_reason(qlora, device="cpu", left=1e9, shapes={"large": large}) is None
    narrow = dataclasses.replace(kit.SHAPES["tiny"], name="narrow", hidden=64, intermediate=128)
    assert not kit.nf4_holds(narrow)  # a 64 x 128 projection: 8,192 elements, half a block group
    with mock.patch.dict(kit.SHAPES, narrow=narrow):
        reason = kit.skip_reason(qlora, device="cpu", left=1e9, shapes={"large": "narrow"})
    assert "NF4" in reason and "16,384" in reason


def test_tiny_shapes_shorten_the_sequences() -> None:
    rows = {r.name: r for r in kit.ROWS}
    tiny = {"small": "tiny", "large": "tiny"}
    assert kit.scaled(rows["1b-bf16"], tiny).seq == 64
    assert kit.scaled(rows["8b-lora-32k"], tiny).seq == 1024
    assert kit.scaled(rows["8b-lora-32k"], {"small": "1b", "large": "8b"}).seq == 32768


def test_summary_medians_after_warmup_and_peaks_over_all_steps() -> None:
    records = [{"kind": "start", "step": 0}]
    for step in range(1, 7):
        records.append(
            {
                "kind": "train",
                "step": step,
                "loss": 10.0 - step,
                "tokens_per_s_per_device": 100.0 * step,
                "mfu_pct": float(step),
                "step_time_s": 1.0,
                "cuda_peak_allocated_gib": 5.0 if step != 2 else 9.0,
                "cuda_peak_reserved_gib": 6.0,
            }
        )
    records.append({"kind": "checkpoint", "seconds": 2.5, "step": 6})
    summary = kit.summarize(records, warmup=3)
    assert summary["tokens_per_s_per_gpu"] == 500.0  # median of steps 4, 5, 6
    assert summary["mfu_pct"] == 5.0
    assert summary["peak_allocated_gib"] == 9.0  # the peak of step 2 counts
    assert summary["checkpoint_save_s"] == 2.5
    assert summary["final_loss"] == 4.0


def test_margin_suggestion_and_table() -> None:
    rows = [
        {"name": "1b-bf16", "kind": "train", "status": "ok", "shape": "1b", "parameters": 1.1e9,
         "seq": 2048, "batch": 4, "tokens_per_s_per_gpu": 20000.0, "mfu_pct": 41.0,
         "peak_allocated_gib": 20.0, "peak_reserved_gib": 22.0, "smi_peak_gib": 23.5,
         "planned_peak_gib": 19.5, "allocated_over_plan": 20 / 19.5,
         "reserved_over_plan": 22 / 19.5, "used_over_required": 0.9},
        {"name": "1b-fp16", "kind": "train", "status": "failed", "reason": "exit 1"},
        {"name": "8b-qlora-4k", "kind": "train", "status": "skipped", "reason": "no --quantize"},
        {"name": "1b-evaluate", "kind": "evaluate", "status": "ok",
         "summary": "arc_easy: 400 requests in 2.0 s (200.0 requests/s)"},
    ]  # fmt: skip
    margin = kit.margin_suggestion(rows)
    assert margin is not None
    assert margin["allocator_fraction"] == pytest.approx(0.1)
    assert margin["runtime_gib"] == pytest.approx(1.5)
    # 19.5 GiB planned, 22 reserved: a share of 13% (19.5 x 1.13 = 22.035) misses by 0.16%.
    assert margin["fitted_fraction"] == pytest.approx(0.13)
    assert margin["fitted_error"] == pytest.approx(abs(19.5 * 1.13 - 22) / 22)
    table = kit.render_table(
        {"gpu": "H100", "gpus": 1, "torch": "2.11.0+cu130", "rows": rows, "seconds": 300,
         "environment": {"driver": "580.159.04", "transformers": "5.21.0"},
         "margin_suggestion": margin}
    )  # fmt: skip
    assert "| 1b-bf16 | 1b (1.10B) | 2048 x 4 | 20,000 | 41.0 |" in table
    assert "- 1b-fp16: failed: exit 1" in table
    assert "- 8b-qlora-4k: skipped: no --quantize" in table
    assert "- 1b-evaluate: arc_easy: 400 requests" in table
    assert "driver 580.159.04" in table and "allocator +10.0%" in table
    assert "nearest every reserved peak: +13.0%" in table


def test_evaluation_requests_are_timed_from_the_models_own_log_lines() -> None:
    log = (
        "model: runs/x/final (llama), bf16-true, FSDP2 over 1 process(es) on cuda, loaded in 3.1s\n"
        "loglikelihood: 1600 requests as 1590 distinct inputs on 1 rank(s), 2.5s\n"
        "generate_until: 10 requests on 1 rank(s), 1.5s\n"
        "results: lm_eval/results.json\n"
    )
    assert kit.request_times(log) == (1610, 4.0)
    assert kit.request_times("nothing timed") == (0, 0.0)


def test_without_cuda_one_line_and_exit_2() -> None:
    result = launch(1, "bench/gpu_check.py", [], timeout=120)  # the script as its own process
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


# --- the carried wheels ------------------------------------------------------------------------


def _wheel(folder: Path, name: str, version: str, tag: str, requires: list[str]) -> Path:
    """A minimal wheel: the file name and a METADATA with its requirements."""
    path = folder / f"{name}-{version}-{tag}.whl"
    metadata = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
    metadata += [f"Requires-Dist: {line}" for line in requires]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
    return path


def _carried(tmp_path: Path, skip: str = "") -> Path:
    folder = tmp_path / "whl"
    folder.mkdir(parents=True)
    for carried in stack.CARRIED:
        if carried.name != skip:
            name = carried.name.replace("-", "_")
            _wheel(folder, name, carried.version, "py3-none-any", [])
    return folder


def test_a_complete_folder_passes_and_each_fault_is_named(tmp_path: Path) -> None:
    assert stack.check_folder(_carried(tmp_path), "3.12") == []

    missing = _carried(tmp_path / "a", skip="transformers")
    assert stack.check_folder(missing, "3.12") == [
        "missing: transformers==5.21.0 (python bench/device_stack.py download)"
    ]
    twice = _carried(tmp_path / "b")
    _wheel(twice, "transformers", "5.17.0", "py3-none-any", [])
    (problem,) = stack.check_folder(twice, "3.12")
    assert problem.startswith("transformers: 2 wheels")
    extra = _carried(tmp_path / "c")
    _wheel(extra, "torch", "2.11.0", "cp312-cp312-manylinux_2_28_x86_64", [])
    assert stack.check_folder(extra, "3.12") == [
        "not listed in CARRIED: torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    ]


def test_wheels_for_another_python_or_platform_are_refused(tmp_path: Path) -> None:
    folder = _carried(tmp_path, skip="multiprocess")
    wheel = _wheel(folder, "multiprocess", "0.70.19", "py312-none-any", [])
    assert stack.check_folder(folder, "3.12") == []
    assert stack.check_folder(folder, "3.11") == [
        f"{wheel.name}: not installable on CPython 3.11 x86_64"
    ]
    wheel.unlink()
    mac = _wheel(folder, "multiprocess", "0.70.19", "cp312-cp312-macosx_11_0_arm64", [])
    assert stack.check_folder(folder, "3.12") == [
        f"{mac.name}: not installable on CPython 3.12 x86_64"
    ]


def test_every_requirement_of_a_carried_wheel_is_on_the_image_or_carried(tmp_path: Path) -> None:
    folder = _carried(tmp_path, skip="nltk")
    requires = ["click", "joblib", "defusedxml", "ujson>=5", 'pytest; extra == "test"']
    requires.append('tomli; python_version < "3.11"')
    _wheel(folder, "nltk", "3.10.4", "py3-none-any", requires)
    # click and joblib are on the image, defusedxml is carried; extras and markers that do not
    # apply are not needed.
    assert stack.check_folder(folder, "3.12") == ["unmet: nltk needs ujson (on neither list)"]


def test_the_image_list_is_kinds_md_copied() -> None:
    names = stack.IMAGE_PACKAGES
    assert {"torch", "transformers", "huggingface-hub", "peft", "pyarrow", "zipp"} <= names
    assert not names & {"datasets", "lm-eval", "submitit", "chess"}  # what we must carry
    assert len(names) == 197


def test_install_takes_only_what_the_python_lacks(tmp_path: Path, monkeypatch) -> None:
    """Not installed: carried. Installed in the declared range: kept. Installed outside it
    (transformers 5.17 on the image against >=5.21): carried."""
    import importlib.metadata

    versions = {"transformers": "5.17.0", "peft": "0.21.1", "chess": None}

    def version(name: str) -> str:
        found = versions.get(name)
        if found is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(stack.importlib.metadata, "version", version)
    folder = tmp_path / "whl"
    folder.mkdir()
    for name, pin in [("transformers", "5.21.0"), ("peft", "0.21.2"), ("chess", "1.10.0")]:
        _wheel(folder, name, pin, "py3-none-any", [])
    chosen = {w.name: why for w, why in stack.choose(stack.read_folder(folder))}
    assert chosen == {
        "transformers": "5.17.0 installed, transformers>=5.21.0 declared",
        "chess": "not installed",
    }


def test_a_command_runs_in_its_own_group_and_is_killed_whole_at_its_time_limit(
    tmp_path: Path,
) -> None:
    """The kit's one way to start a process (the whole-flow test below forks them instead)."""
    log, errors = tmp_path / "log", tmp_path / "errors"
    script = "import os, sys; print(os.getpgid(0) == os.getpid(), flush=True); "
    script += "print('err', file=sys.stderr); sys.exit(3)"
    code = kit.run_process(
        [sys.executable, "-c", script], env=dict(os.environ), timeout=60, log=log
    )
    assert code == 3 and log.read_text().split() == ["True", "err"]
    code = kit.run_process(
        [sys.executable, "-c", script], env=dict(os.environ), timeout=60, log=log, errors=errors
    )
    assert (log.read_text(), errors.read_text()) == ("True\n", "err\n")
    # A child that outlives the limit, with a grandchild in its group: 124, as timeout(1) says.
    sleeper = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    code = kit.run_process(
        [sys.executable, "-c", sleeper], env=dict(os.environ), timeout=1, log=log
    )
    assert code == 124


def _forked(
    command: list[str],
    *,
    env: dict[str, str],
    timeout: float,
    log: Path,
    errors: Path | None = None,
) -> int:
    """The kit's `run_process` through tests/prefork.py: each command (`python -m ...`, `python
    SCRIPT`, `torchrun --standalone --nproc_per_node=N SCRIPT`) is still a process of its own
    with its arguments, environment and exit code, forked from the pre-imported server instead
    of paying torch's imports (and torchrun's agent) each time."""
    if Path(command[0]).name == "torchrun":
        nproc = int(next(a.split("=", 1)[1] for a in command if a.startswith("--nproc_per_node=")))
        start = next(i for i, a in enumerate(command[1:], 1) if not a.startswith("--"))
        target, args, distributed = command[start], command[start + 1 :], True
    else:
        assert command[0] == sys.executable, command
        nproc, target, args, distributed = 1, command[1], command[2:], False
    if target != "-m":
        target = str(Path(target).resolve().relative_to(REPO))
    # One thread per process: the kit asks 4 of a GPU node's cores; this machine has 2.
    env = {**env, "OMP_NUM_THREADS": "1"}
    try:
        result = launch(nproc, target, args, env=env, timeout=timeout, distributed=distributed)
        code, out, err = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as expired:
        code, out, err = 124, str(expired.stdout or ""), str(expired.stderr or "")
    log.write_text(out if errors else out + err)
    if errors:
        errors.write_text(err)
    return code


@pytest.mark.slow
def test_the_whole_flow_runs_on_cpu(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every kind of row with the tiny shape on CPU: a training run against the planner, the
    save/resume/export cycle, the masking probe and the evaluation of the export (the full
    dry run, from the carried wheels at the device's versions, QLoRA's row included: make
    gpu-check-dry-run; QLoRA itself: tests/test_qlora.py). The kit runs in this process and
    its commands are forked (`_forked`): no interpreter or torchrun agent starts per command,
    52 s of CPU instead of 159 (2026-11-27)."""
    out = tmp_path / "out"
    monkeypatch.setattr(kit, "run_process", _forked)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # main() tees it into gpu_check.log
    code = kit.main(
        ["--allow-cpu", "--shapes", "tiny", "--budget", "0",
         "--only", "1b-bf16,1b-checkpoint,1b-masking,1b-evaluate,1b-bf16-offload",
         "--games", "200", "--output", str(out), "--work", str(tmp_path / "work")],
    )  # fmt: skip
    if isinstance(sys.stdout, kit.Tee):
        sys.stdout.file.close()
    captured = capsys.readouterr()
    report = json.loads((out / "gpu_check.json").read_text())
    outcomes = [(r["name"], r["status"], r.get("reason")) for r in report["rows"]]
    assert code == 0, (outcomes, captured.out[-3000:], captured.err[-3000:])
    rows = {r["name"]: r for r in report["rows"]}
    train = rows["1b-bf16"]
    assert train["status"] == "ok" and train["steps_logged"] == 12
    assert train["tokens_per_s_per_gpu"] > 0
    assert train["planned_peak_gib"] and train["planned_peak_gib"] > 0  # the planner ran
    cycle = rows["1b-checkpoint"]
    assert cycle["status"] == "ok" and cycle["resumed"] is True
    assert None not in (cycle["save_s"], cycle["load_s"], cycle["export_s"])
    assert Path(cycle["final_model"], "config.json").is_file()
    masking = rows["1b-masking"]
    assert [c["verdict"] for c in masking["cases"]] == ["pass", "pass"], masking["cases"]
    evaluation = rows["1b-evaluate"]
    assert evaluation["status"] == "ok" and evaluation["requests"] > 0
    assert evaluation["requests_per_s"] > 0
    assert rows["1b-bf16-offload"]["status"] == "skipped"
    assert "| 1b-bf16 | tiny" in (out / "gpu_check.md").read_text()
    assert "torch" in (out / "versions.txt").read_text()
    with __import__("tarfile").open(out / "logs.tar.gz") as archive:
        assert "logs/1b-bf16.log" in archive.getnames()
    assert "gpu-check: 1b-evaluate" in (out / "gpu_check.log").read_text()
