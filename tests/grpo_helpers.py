"""What the GRPO tests share: a prompt set from the tiny games, reward files, and the flags of a
short run on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.train_helpers import as_flags

# Reward functions with TRL's signature, written to a file per test as users write theirs.
REWARDS = '''
import json
import os
from pathlib import Path

STOPS = Path(__file__).with_name("stops.json")  # [[global_step, call, stop_file], ...]
_calls = {}


def scored(completion_ids, trainer_state, **kwargs):
    """A class of first tokens (about a tenth of the vocabulary), and a little for ending
    early: rewards that differ within a group. Asks the run to stop (writes its STOP file)
    where stops.json says: at the Nth call of a step, on rank 0."""
    step = trainer_state.global_step
    call = _calls[step] = _calls.get(step, -1) + 1
    # Rank 0 alone reads and rewrites the plan (another rank reading it then could see half).
    plan = json.loads(STOPS.read_text()) if os.environ.get("RANK", "0") == "0" and STOPS.exists() else []
    if plan and plan[0][:2] == [step, call]:
        Path(plan[0][2]).write_text("")
        STOPS.write_text(json.dumps(plan[1:]))
    return [(1.0 if ids and 100 <= ids[0] < 150 else 0.0) + 0.25 * (len(ids) < 4)
            for ids in completion_ids]


def first_token_class(completion_ids, **kwargs):
    return [1.0 if ids and 100 <= ids[0] < 150 else 0.0 for ids in completion_ids]


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def raises_on_rank_1(completions, **kwargs):
    if os.environ.get("RANK", "0") == "1":
        raise RuntimeError("the judge is out to lunch")
    return [0.0] * len(completions)


def wrong_length(completions, **kwargs):
    return [1.0]


def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)


from fsdp_utils.chess_eval.rewards import EngineReward, positions


class EngineThatDies(EngineReward):
    """The engine's centipawn reward on `engine` beside this file (tests/fake_bin/
    flaky-stockfish, linked), asked about every batch's first position: its engine dies once
    in step 2 (restarted, the reward goes on), then at every search from step 3 on."""

    def __call__(self, completions, trainer_state, **kwargs):
        step = trainer_state.global_step
        if step in (1, 2):
            marker = "engine.die-once" if step == 1 else "engine.die"
            Path(__file__).with_name(marker).touch()
        self.judge.search_before(positions(kwargs)[0])
        return super().__call__(completions, **kwargs)


engine_dies = EngineThatDies(
    depth=2, kind="centipawn", path=str(Path(__file__).with_name("engine")), name="engine_dies"
)
'''


FLAKY_ENGINE = Path(__file__).parent / "fake_bin" / "flaky-stockfish"


def write_rewards(folder: Path, stops: list[list[Any]] | None = None) -> Path:
    """rewards.py in `folder` (its own: `scored` reads the stops.json beside it), and `engine`,
    a link to the flaky engine that `engine_dies_at_step_2` uses."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text(REWARDS)
    if not (folder / "engine").is_symlink():
        (folder / "engine").symlink_to(FLAKY_ENGINE)
    if stops is not None:
        (folder / "stops.json").write_text(json.dumps(stops))
    return folder / "rewards.py"


def write_prompts(games_dir: Path, out: Path, *, max_plies: int = 8) -> Path:
    """The tiny games' positions as prompts (fsdp_utils.chess_eval.prompt_set)."""
    from fsdp_utils.chess_eval.prompt_set import positions, read_games
    from fsdp_utils.config.train_config import DEFAULT_TEMPLATE

    rows = positions(
        read_games(games_dir), template=DEFAULT_TEMPLATE, per_game=2, seed=0,
        max_plies=max_plies,
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def grpo_args(
    model: Path, prompts: Path, output_dir: Path, data_cache: Path, **overrides: Any
) -> list[str]:
    """Flags of a short GRPO run on the tiny model; overrides use flag names."""
    options: dict[str, Any] = {
        "method": "grpo",
        "model": model,
        "dataset": prompts,
        "output_dir": output_dir,
        "data_cache_dir": data_cache,
        "num_generations": 4,
        "max_completion_length": 4,
        "max_seq_length": 64,
        "total_batch_size": 4,
        "batch_size_per_device": 1,
        "max_training_steps": 4,
        "precision": "fp32",
        "learning_rate": 3e-3,
        "warmup_steps": 0,
        "eval_examples": 16,
        "eval_every": 0,
        "eval_batches": 2,
        "save_every_minutes": 0,
        "log_every": 1,
        "log_completions_every": 1,
    }
    options.update(overrides)
    return as_flags(options)
