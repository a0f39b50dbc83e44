"""A chess model that plays, from nothing, in one command: engine data, SFT, GRPO with a dense
engine reward, then the judge and the masked ladder (docs/chess-eval.md, "A model that plays").

    python bench/chess_recipe.py                        # 2 CPU cores, about an hour in all
    python bench/chess_recipe.py --quick                # the same stages in a few minutes
    python bench/chess_recipe.py --preset gpu-node      # a GPU node: bigger model, more data
    python bench/chess_recipe.py --data data/engine_games   # games made by the array job

1. data: `--games` engine games (`python -m fsdp_utils.chess_eval.selfplay`, Stockfish at depth
   1 from random 4-8-ply openings; `--mix` adds games against a random mover and random ones),
   on `--processes` processes; or `--data DIR`, a folder the array job made
   (`sbatch --array=0-N slurm/selfplay.sh --games ... --output DIR`);
2. model: a Llama of `--hidden` x `--layers` with a word-level tokenizer, one token per UCI move
   (`fsdp_utils.synthetic.uci_tokenizer`: the model's next-token distribution is a distribution
   over moves, a game of 90 plies is 90 tokens, a masked move costs one forward);
3. SFT on the games (`chess_finetune.py`), `--sft_steps`, the legal-move rate of held-out games'
   positions every `--sft_steps // 8` steps (the learning curve);
4. GRPO from the SFT model (`--method grpo --reward_funcs chess_centipawn`: 1 - cp_loss / 1000
   for a legal move, -1 for an illegal one, Stockfish at `--grpo_depth`) on positions of the
   training games (never the held-out ones), `--grpo_steps`, held-out rewards every
   `--grpo_steps // 4` steps;
5. the judge (`python -m fsdp_utils.chess_eval`) on the SFT model and on the GRPO model: the
   held-out games' positions (`--eval_games` games x 3 phases + balanced ones, each distinct
   position once, the next move greedy and unmasked), Stockfish at depth `--judge_depth` (10,
   the judge's default); and the ladder: `--ladder_games` games against each rung of `--ladder`
   (random, Skill Level 0), colours alternated, unmasked and masked, reported apart.

It prints the figures against the goals of issue 62 and writes them, with every stage's wall
time and CPU seconds (its processes and the engines they started) and the load average, to
`<root>/recipe.json` and `bench/results/chess_recipe.json` / `.md`. Stages whose output exists
are reused (`--fresh` to start over); the CPU seconds and times are then those of the run that
made them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

# Issue 62's goals: (metric, comparison, threshold, what it means).
GOALS = (
    ("legal_move_rate", ">=", 0.90, "greedy unmasked legal moves, held-out positions"),
    ("engine_centipawn_loss", "<=", 60.0, "centipawn loss of its legal moves, judge depth 10"),
    ("engine_accuracy", ">=", 85.0, "Lichess accuracy of its legal moves, judge depth 10"),
    ("ladder_masked_skill0_score", ">", 0.5, "masked games vs Skill Level 0: a positive score"),
    ("ladder_masked_random_score", ">=", 0.9, "masked games vs a random mover: won widely"),
)


@dataclass
class Settings:
    """One recipe's sizes (the presets, then the flags)."""

    games: int = 16000
    mix: str = "selfplay:9,vs_random:1"
    selfplay_depth: int = 1
    processes: int = 2
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    seq_len: int = 256
    batch_size: int = 32  # sequences per optimizer step
    micro_batch: int = 16  # sequences per forward (per process)
    sft_steps: int = 800
    lr: float = 1.5e-3
    nproc: int = 2  # training processes (CPU: one thread each, gloo)
    precision: str = "fp32"
    grpo_steps: int = 60
    grpo_prompts: int = 16  # prompts per GRPO step
    grpo_generations: int = 8
    grpo_lr: float = 5e-5
    grpo_depth: int = 6
    grpo_temperature: float = 1.0
    eval_games: int = 64
    judge_depth: int = 10
    ladder: str = "random,skill:0"
    ladder_games: int = 40
    threads: int = 1  # OMP threads per training process

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    # The stages in minutes: for trying the recipe, not for its figures.
    "quick": {"games": 1200, "hidden": 128, "layers": 2, "heads": 4, "sft_steps": 120,
              "grpo_steps": 6, "grpo_prompts": 8, "eval_games": 16, "ladder_games": 4,
              "judge_depth": 6},
    # One GPU node (4-8 GPUs): 20x the games (made by the array job: --data), a 30M model.
    "gpu-node": {"games": 240000, "processes": 16, "hidden": 512, "layers": 8, "heads": 8,
                 "batch_size": 256, "micro_batch": 32, "sft_steps": 20000, "lr": 6e-4,
                 "nproc": 4, "precision": "bf16-mixed", "grpo_steps": 400, "grpo_prompts": 64,
                 "grpo_lr": 5e-6, "grpo_depth": 8, "eval_games": 200, "ladder_games": 100,
                 "ladder": "random,skill:0,skill:3,elo:1350", "threads": 4},
}  # fmt: skip


@dataclass
class Stage:
    name: str
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    reused: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Recipe:
    def __init__(self, root: Path, settings: Settings, *, data: Path | None, device: str) -> None:
        self.root, self.s, self.device = root, settings, device
        self.data = data or root / "data"
        self.stages: list[Stage] = []
        self.record_path = root / "recipe.json"
        self.env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads),
                    "PYTHONPATH": str(REPO)}  # fmt: skip

    # --- running a stage ---------------------------------------------------------------

    def run(self, name: str, command: list[str], *, done: Path, **extra: Any) -> Stage:
        """Run `command` unless `done` exists; its wall time and CPU seconds (the process
        and every child it waited for: the training ranks, the engines)."""
        stage = Stage(name, load_before=os.getloadavg()[0], extra=extra)
        if done.exists():
            stage.reused = True
            previous = self._previous(name)
            if previous is not None:  # the figures of the run that made it
                for key in ("wall_seconds", "cpu_seconds", "load_before", "load_after"):
                    setattr(stage, key, previous[key])
            print(f"[{name}] reusing {done}", flush=True)
        else:
            print(f"[{name}] {' '.join(command)}", flush=True)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            result = subprocess.run(command, cwd=REPO, env=self.env)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            stage.wall_seconds = time.perf_counter() - started
            stage.cpu_seconds = (after.ru_utime - before.ru_utime) + (
                after.ru_stime - before.ru_stime
            )
            if result.returncode != 0:
                raise SystemExit(f"[{name}] failed (exit {result.returncode}): {' '.join(command)}")
            stage.load_after = os.getloadavg()[0]
        self.stages.append(stage)
        print(
            f"[{name}] {stage.wall_seconds:.0f} s wall, {stage.cpu_seconds:.0f} CPU s, load "
            f"{stage.load_before:.1f} -> {stage.load_after:.1f}", flush=True,
        )  # fmt: skip
        return stage

    def _previous(self, name: str) -> dict[str, Any] | None:
        if not self.record_path.is_file():
            return None
        for stage in json.loads(self.record_path.read_text()).get("stages", []):
            if stage["name"] == name and not stage["reused"]:
                return dict(stage)
        return None

    # --- the stages --------------------------------------------------------------------

    def make_data(self) -> None:
        s = self.s
        command = [
            sys.executable, "-m", "fsdp_utils.chess_eval.selfplay", "--games", str(s.games),
            "--output", str(self.data), "--depth", str(s.selfplay_depth), "--mix", s.mix,
            "--processes", str(s.processes), "--shard_games", str(max(100, -(-s.games // 24))),
        ]  # fmt: skip
        self.run("data", command, done=self.data / "selfplay.json")

    def make_model(self) -> tuple[Path, int]:
        """The model's folder and how many parameters it has."""
        folder = self.root / "model"
        stage = Stage("model")
        if not (folder / "config.json").is_file():
            from fsdp_utils.synthetic import save_tiny_model, uci_tokenizer

            save_tiny_model(
                folder, uci_tokenizer(), arch="llama", hidden_size=self.s.hidden,
                num_layers=self.s.layers, num_heads=self.s.heads, max_positions=self.s.seq_len,
            )  # fmt: skip
        else:
            stage.reused = True
        stage.extra["parameters"] = parameters(folder)
        self.stages.append(stage)
        print(f"[model] {folder}: {stage.extra['parameters'] / 1e6:.2f}M parameters", flush=True)
        return folder, stage.extra["parameters"]

    def train_command(self, *args: str) -> list[str]:
        if self.s.nproc > 1:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            return [torchrun, "--standalone", f"--nproc_per_node={self.s.nproc}",
                    str(REPO / "chess_finetune.py"), *args]  # fmt: skip
        return [sys.executable, str(REPO / "chess_finetune.py"), *args]

    def sft(self, model: Path) -> Path:
        s = self.s
        out = self.root / "sft"
        every = max(1, s.sft_steps // 8)
        command = self.train_command(
            "--model", str(model), "--dataset", str(self.data), "--output_dir", str(out),
            "--data_cache_dir", str(self.root / "cache"), "--max_seq_length", str(s.seq_len),
            "--total_batch_size", str(s.batch_size), "--batch_size_per_device", str(s.micro_batch),
            "--max_training_steps", str(s.sft_steps), "--learning_rate", str(s.lr),
            "--warmup_steps", str(max(1, s.sft_steps // 20)), "--lr_schedule", "cosine",
            "--precision", s.precision, "--eval_every", str(every), "--eval_batches", "8",
            "--eval_examples", str(max(200, s.eval_games)), "--log_every", str(max(1, every // 4)),
            "--save_every_minutes", "0", "--save_every_steps", str(s.sft_steps),
            "--resume", "never", "--document_masking", "--chess_eval_every", str(every),
            "--chess_eval_games", str(s.eval_games), "--chess_eval_plies", "1",
            "--chess_eval_engine", "off", "--device", self.device,
        )  # fmt: skip
        self.run("sft", command, done=out / "final" / "config.json")
        return out

    def prompts(self, sft: Path) -> Path:
        """Positions of the SFT run's training games (never its held-out ones) as GRPO
        prompts, in its template: the model writes the next move."""
        out = self.root / "prompts.jsonl"
        if out.is_file():
            return out
        from fsdp_utils.chess_eval.prompt_set import positions
        from fsdp_utils.chess_eval.selfplay import read_games
        from fsdp_utils.config.parse import config_from_dict
        from fsdp_utils.data.prepare import split_rows

        record = json.loads((sft / "config.json").read_text())["config"]
        config = config_from_dict(record, source=str(sft / "config.json"))
        games = read_games(self.data)
        train = sorted(int(i) for i in split_rows(config, len(games))["train"])
        wanted = self.s.grpo_steps * self.s.grpo_prompts + 256
        chosen = [games[i] for i in train[:wanted]]
        rows = list(positions(chosen, template=config.template, per_game=1, seed=1,
                              max_plies=self.s.seq_len // 2))  # fmt: skip
        with open(out, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"[prompts] {len(rows)} positions of {len(chosen)} training games -> {out}")
        return out

    def grpo(self, sft: Path, prompts: Path) -> Path:
        s = self.s
        out = self.root / "grpo"
        every = max(1, s.grpo_steps // 4)
        # chess_centipawn at --grpo_depth (the built-in's depth is fixed): a reward file.
        rewards = self.root / "rewards.py"
        rewards.write_text(
            "from fsdp_utils.chess_eval.rewards import EngineReward\n\n"
            f"engine = EngineReward(depth={s.grpo_depth}, kind='centipawn', "
            "name='chess_centipawn')\n"
        )
        command = self.train_command(
            "--method", "grpo", "--model", str(sft / "final"), "--dataset", str(prompts),
            "--output_dir", str(out), "--data_cache_dir", str(self.root / "cache"),
            "--reward_funcs", f"{rewards}:engine", "--num_generations", str(s.grpo_generations),
            "--max_completion_length", "1", "--max_seq_length", str(s.seq_len),
            "--total_batch_size", str(s.grpo_prompts),
            "--batch_size_per_device", str(max(1, s.grpo_prompts // s.nproc)),
            "--max_training_steps", str(s.grpo_steps), "--learning_rate", str(s.grpo_lr),
            "--warmup_steps", "0", "--lr_schedule", "constant", "--precision", s.precision,
            "--temperature", str(s.grpo_temperature), "--eval_examples", "128",
            "--eval_every", str(every), "--eval_batches", "16", "--save_every_minutes", "0",
            "--save_every_steps", str(s.grpo_steps), "--log_every", "1",
            "--log_completions_every", str(every), "--resume", "never", "--device", self.device,
        )  # fmt: skip
        self.run("grpo", command, done=out / "final" / "config.json")
        return out

    def judge(self, name: str, model: Path, sft: Path) -> dict[str, Any]:
        s = self.s
        out = self.root / f"judge_{name}"
        summary = out / "summary.json"
        command = [
            sys.executable, "-m", "fsdp_utils.chess_eval", str(model), "--config",
            str(sft / "config.json"), "--games", str(s.eval_games), "--plies", "1",
            "--engine", "on", "--depth", str(s.judge_depth), "--ladder", s.ladder,
            "--ladder_games", str(s.ladder_games), "--masking", "both", "--output_dir",
            str(out), "--device", self.device,
        ]  # fmt: skip
        stage = self.run(f"judge_{name}", command, done=summary)
        figures = json.loads(summary.read_text())
        stage.extra["figures"] = {k: v for k, v in figures.items() if not isinstance(v, list)}
        return figures

    # --- the record --------------------------------------------------------------------

    def write(self, results: dict[str, Any]) -> None:
        record = {
            "settings": asdict(self.s),
            "stages": [asdict(st) for st in self.stages],
            "wall_seconds": sum(st.wall_seconds for st in self.stages),
            "cpu_seconds": sum(st.cpu_seconds for st in self.stages),
            "load_average": os.getloadavg(),
            "cpus": os.cpu_count(),
            **results,
        }
        self.record_path.write_text(json.dumps(record, indent=2) + "\n")
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "chess_recipe.json").write_text(json.dumps(record, indent=2) + "\n")
        (RESULTS / "chess_recipe.md").write_text(report(record) + "\n")
        print(report(record))


def parameters(folder: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for path in folder.glob("*.safetensors") for t in load_file(path).values())


def curves(run: Path) -> dict[str, list[dict[str, Any]]]:
    """A run's learning curves from its metrics.jsonl (this run's records)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    records = records[starts[-1] :] if starts else records
    keep = ("step", "loss", "eval_loss", "legal_move_rate", "next_move_accuracy", "reward",
            "eval_reward", "eval_greedy_reward", "engine/restarts")  # fmt: skip
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") in ("train", "eval", "chess_eval"):
            row = {k: r[k] for k in keep if k in r}
            out.setdefault(r["kind"], []).append(row)
    return out


def check(value: float | None, op: str, threshold: float) -> bool | None:
    if value is None:
        return None
    return {">=": value >= threshold, "<=": value <= threshold, ">": value > threshold}[op]


def report(record: dict[str, Any]) -> str:
    lines = ["# The chess recipe (bench/chess_recipe.py)", ""]
    s = record["settings"]
    lines.append(
        f"{s['games']:,} engine games ({s['mix']}), a Llama {s['hidden']} x {s['layers']} "
        f"({record.get('parameters', 0) / 1e6:.2f}M parameters, one token per move), SFT "
        f"{s['sft_steps']} steps of {s['batch_size']} x {s['seq_len']} tokens, GRPO "
        f"{s['grpo_steps']} steps of {s['grpo_prompts']} prompts x {s['grpo_generations']} "
        f"(chess_centipawn at depth {s['grpo_depth']})."
    )
    lines.append("")
    lines.append("| stage | wall | CPU seconds | load (before -> after) |")
    lines.append("|---|---:|---:|---|")
    for st in record["stages"]:
        reused = " (reused)" if st["reused"] else ""
        lines.append(
            f"| {st['name']}{reused} | {st['wall_seconds'] / 60:.1f} min | "
            f"{st['cpu_seconds']:.0f} | {st['load_before']:.1f} -> {st['load_after']:.1f} |"
        )
    lines.append(
        f"| all | {record['wall_seconds'] / 60:.1f} min | {record['cpu_seconds']:.0f} | "
        f"{record['cpus']} CPUs |"
    )
    lines.append("")
    lines.append("| goal | SFT | SFT + GRPO | target |")
    lines.append("|---|---:|---:|---|")
    for key, op, threshold, what in GOALS:
        row = []
        for name in ("sft", "grpo"):
            value = record.get(name, {}).get(key)
            ok = check(value, op, threshold)
            mark = "" if ok is None else (" ✓" if ok else " ✗")
            row.append(_fmt(key, value) + mark)
        lines.append(f"| {what} (`{key}`) | {row[0]} | {row[1]} | {op} {_fmt(key, threshold)} |")
    for key in ("engine_all_centipawn_loss", "engine_all_accuracy", "engine_positions",
                "engine_moves", "engine_illegal", "ladder_skill0_score", "ladder_random_score",
                "ladder_masked_skill0_elo_diff", "ladder_masked_centipawn_loss",
                "ladder_masked_accuracy", "ladder_masked_legal_mass"):  # fmt: skip
        values = [_fmt(key, record.get(name, {}).get(key)) for name in ("sft", "grpo")]
        lines.append(f"| `{key}` | {values[0]} | {values[1]} | |")
    lines.extend(["", *curve_lines(record.get("curves", {}))])
    return "\n".join(lines)


def curve_lines(curves: dict[str, Any]) -> list[str]:
    """The learning curves as tables: SFT (loss, held-out loss, legal-move rate of held-out
    positions), GRPO (the reward of its samples, held-out sampled and greedy rewards)."""
    lines = []
    sft = curves.get("sft", {})
    if sft.get("chess_eval"):
        evals = {r["step"]: r for r in sft.get("eval", [])}
        train = {r["step"]: r for r in sft.get("train", [])}
        lines += ["| SFT step | train loss | held-out loss | legal moves (held-out positions) |",
                  "|---:|---:|---:|---:|"]  # fmt: skip
        for r in sft["chess_eval"]:
            step = r["step"]
            near = train.get(step) or min(train.values(), key=lambda t: abs(t["step"] - step))
            lines.append(
                f"| {step} | {near.get('loss', float('nan')):.3f} | "
                f"{evals.get(step, {}).get('eval_loss', float('nan')):.3f} | "
                f"{100 * r['legal_move_rate']:.1f}% |"
            )
        lines.append("")
    grpo = curves.get("grpo", {})
    if grpo.get("eval"):
        rewarded = [r for r in grpo.get("train", []) if "reward" in r]
        lines += ["| GRPO step | train reward (mean since the last row) | held-out sampled | "
                  "held-out greedy |", "|---:|---:|---:|---:|"]  # fmt: skip
        last = 0
        for r in grpo["eval"]:
            window = [t["reward"] for t in rewarded if last < t["step"] <= r["step"]]
            mean = sum(window) / len(window) if window else float("nan")
            lines.append(
                f"| {r['step']} | {mean:.3f} | {r.get('eval_reward', float('nan')):.3f} | "
                f"{r.get('eval_greedy_reward', float('nan')):.3f} |"
            )
            last = r["step"]
    return lines


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if not isinstance(value, float):
        return str(value)
    if key.endswith(("_rate", "_score", "legal_mass")):
        return f"{100 * value:.1f}%"
    return f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "chess-recipe")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="--preset quick")
    parser.add_argument("--data", type=Path, help="engine games made already (the array job)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--fresh", action="store_true", help="remove --root first")
    parser.add_argument("--skip_grpo", action="store_true", help="data, SFT and the judge only")
    for name, default in asdict(Settings()).items():
        parser.add_argument(f"--{name}", type=type(default), default=None)
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else args.preset
    values = {**asdict(Settings()), **PRESETS[preset]}
    values.update({k: v for k, v in vars(args).items() if k in values and v is not None})
    settings = Settings(**values)
    if args.fresh and args.root.exists():
        shutil.rmtree(args.root)
    args.root.mkdir(parents=True, exist_ok=True)
    recipe = Recipe(args.root, settings, data=args.data, device=args.device)
    print(f"chess recipe ({preset}): {settings.describe()}\n  root {args.root}, load "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    if args.data is None:
        recipe.make_data()
    model, count = recipe.make_model()
    sft = recipe.sft(model)
    results: dict[str, Any] = {"parameters": count}
    results["sft"] = recipe.judge("sft", sft / "final", sft)
    results["curves"] = {"sft": curves(sft)}
    if not args.skip_grpo:
        grpo = recipe.grpo(sft, recipe.prompts(sft))
        results["grpo"] = recipe.judge("grpo", grpo / "final", sft)
        results["curves"]["grpo"] = curves(grpo)
    recipe.write(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
