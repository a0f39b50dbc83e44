"""Every command line of ours forgives as a YAML config does (issue 48): a misspelt flag is
answered with the closest one, and a flag is accepted with dashes or underscores
(`fsdp_utils/arguments.py`, `monitoring/arguments.py`). The commands are called in-process,
through the same `main` their scripts call."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_utils.config.parse import parse_config

REPO = Path(__file__).resolve().parent.parent


def _finetune(argv: list[str]) -> int:
    from fsdp_utils.cli import main

    return main(argv)


def _download(argv: list[str]) -> int:
    from fsdp_utils.download import main

    return main(argv)


def _evaluate(argv: list[str]) -> int:
    from fsdp_utils.lm_harness.cli import main

    return main(argv)


def _gpu_report(argv: list[str]) -> int:
    from monitoring.cli import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from fsdp_utils.plan import main

    return main(argv)


MISSPELT: list[tuple[str, Callable[[list[str]], int], list[str], str]] = [
    ("chess_finetune.py", _finetune, ["--learning_rte", "1e-3"], "--learning_rate"),
    ("chess_finetune.py", _finetune, ["--learning-rte=1e-3"], "--learning_rate"),
    ("download_models.py", _download, ["--evl_tasks", "arc_easy"], "--eval_tasks"),
    # --tasks left out by the typo: argparse stops at the required flag, the hint still comes
    ("fsdp_utils.evaluate", _evaluate, ["--model", "m", "--taks", "arc_easy"], "--tasks"),
    ("gpu_report.py", _gpu_report, ["--run_dri", "runs/x"], "--run_dir"),
    ("fsdp_utils.plan", _plan, ["--gpu_memroy", "80GiB"], "--gpu_memory"),
]


@pytest.mark.parametrize(
    ("command", "main", "argv", "meant"), MISSPELT, ids=[f"{m[0]} {m[2][0]}" for m in MISSPELT]
)
def test_a_misspelt_flag_is_answered_with_the_closest_one(capsys, command, main, argv, meant):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    typo = argv[-2 if "=" not in argv[-1] else -1].partition("=")[0]
    assert f"{typo}: did you mean {meant}?" in err, err
    assert err.rstrip().endswith("--help."), err  # the last line names where the flags are


def test_dashed_and_underscored_spellings_are_one_flag():
    dashed, _ = parse_config(["--learning-rate", "1e-3", "--batch-size-per-device=4"])
    underscored, _ = parse_config(["--learning_rate", "1e-3", "--batch_size_per_device", "4"])
    assert dashed == underscored and dashed.learning_rate == 1e-3
    # The value of a flag, and whatever follows `--`, are never respelt.
    config, _ = parse_config(
        ["--prompt_template", "--learning-rate {x}", "--response_template", "{y}"]
    )
    assert config.prompt_template == "--learning-rate {x}"

    from fsdp_utils.download import build_parser

    parser = build_parser()
    assert vars(parser.parse_args(["--dataset_include", "a*", "--dataset", "d"])) == vars(
        parser.parse_args(["--dataset-include", "a*", "--dataset", "d"])
    )
    from fsdp_utils.lm_harness.cli import build_parser as evaluate_parser

    args = evaluate_parser().parse_args(["--model", "m", "--tasks", "t", "--num-fewshot", "3"])
    assert args.num_fewshot == 3


def test_gpu_report_takes_run_dir_both_ways(tmp_path):
    from monitoring.cli import parse_args

    underscored, _ = parse_args(["--run_dir", str(tmp_path), "--timeline_bins", "6"])
    dashed, _ = parse_args(["--run-dir", str(tmp_path), "--timeline-bins", "6"])
    assert underscored == dashed and underscored.run_dir == tmp_path
    assert underscored.timeline_bins == 6


def test_the_scripts_answer_a_typo_too():
    """As users run them (the scripts are thin; their parsers are the ones tested above)."""
    for script, typo, meant in (
        ("download_models.py", "--chek-offline", "--check-offline"),
        ("monitoring/gpu_report.py", "--form-file", "--from_file"),
    ):
        result = subprocess.run(
            [sys.executable, script, typo], capture_output=True, text=True, cwd=REPO, timeout=120
        )
        assert result.returncode == 2, result.stderr
        assert f"did you mean {meant}?" in result.stderr, result.stderr


def test_every_command_line_uses_the_forgiving_parser():
    """argparse's own parser would answer a typo with a bare "unrecognized arguments"."""
    plain = re.compile(r"argparse\.ArgumentParser\(")
    found = [
        str(path.relative_to(REPO))
        for folder in ("fsdp_utils", "monitoring")
        for path in (REPO / folder).rglob("*.py")
        if plain.search(path.read_text())
    ]
    assert found == [], found
