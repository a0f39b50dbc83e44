"""Rollouts from the sharded policy, as a training method samples them, recorded for the test.

    torchrun --nproc_per_node 2 tests/rollout_probe.py MODEL_DIR OUT.json

Builds the tiny model the way the Trainer does (meta, FSDP2 per decoder layer and root,
materialised, loaded), deals `PROMPTS` x `GENERATIONS` rows round-robin to the ranks and samples
them with `PolicyEngine` (seeded per prompt and generation), twice: once in the rows' order and
once reversed. It counts FSDP2's all-gathers with the profiler in a rollout phase (parameters
gathered) and in plain decoding (`continue_prompts` under `no_grad_pass`, as evaluation decodes),
and scores each completion again with the training forward (`token_logprobs` on
`Rollout.training_batch`). Rank 0 writes every row's results, by row, to OUT.json.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

# Run as a script (tests/ is then sys.path[0]): import this checkout's package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = ["e2e4 e7e5 g1f3", "d2d4 d7d5", "c2c4", "e2e4 c7c5 g1f3 d7d6", "g1f3 g8f6 c2c4"]
GENERATIONS = 4
MAX_NEW_TOKENS = 12
TEMPERATURE = 1.3


def sampling() -> Any:
    from fsdp_utils.parallel.generate import Sampling

    return Sampling(TEMPERATURE, top_k=50)


def seed_of(prompt: int, generation: int) -> int:
    from fsdp_utils.parallel.generate import row_seed

    return row_seed(7, "probe", prompt, generation)


def stop_tokens(tokenizer: Any) -> tuple[int, ...]:
    """EOS and 40 more of the 512 words: the untrained tiny model picks nearly uniformly and
    rarely writes EOS, and some rows should end before the limit and some not."""
    return (int(tokenizer.eos_token_id), *range(100, 140))


def _all_gathers(profile: Any) -> int:
    """FSDP2's all-gathers in a profile: its `FSDP::all_gather` ranges (the root's has no
    name after it, each decoder layer's has its own: `FSDP::all_gather (model.layers.0)`)."""
    names = [e.name for e in profile.events()]
    return sum(1 for n in names if n == "FSDP::all_gather" or n.startswith("FSDP::all_gather ("))


def main() -> int:
    from transformers import AutoConfig, AutoTokenizer

    from fsdp_utils.config.parse import parse_config
    from fsdp_utils.model.build import build_meta_model
    from fsdp_utils.model.transforms import transform_model
    from fsdp_utils.model.weights import checkpoint_key_map
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.parallel.generate import (
        PolicyEngine,
        Rollout,
        RolloutSettings,
        continue_prompts,
    )
    from fsdp_utils.parallel.materialize import build_model
    from fsdp_utils.parallel.parallelize import fsdp_group_names, no_grad_pass
    from fsdp_utils.train.loss import LossChunking
    from fsdp_utils.train.step import token_logprobs

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    config, _ = parse_config(["--model", str(model_dir), "--precision", "fp32"])
    env = dist_utils.init_distributed("cpu", timeout_minutes=5)
    clean, model = False, None
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
        meta_model = build_meta_model(hf_config, config.precision)
        key_map = checkpoint_key_map(meta_model, model_dir)
        meta = transform_model(meta_model, config)
        model = build_model(meta, config, env, model_dir, key_map, load_weights=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # Every (prompt, generation) row; rank r takes rows r, r + world, ... (uneven is fine).
        rows = [(p, g) for p in range(len(PROMPTS)) for g in range(GENERATIONS)]
        mine = rows[env.rank :: env.world_size]
        encoded = [tokenizer(PROMPTS[p])["input_ids"] for p, _ in mine]
        seeds = [seed_of(p, g) for p, g in mine]
        settings = RolloutSettings(
            max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stop_tokens(tokenizer),
            pad_token_id=int(tokenizer.pad_token_id), sampling=sampling(),
        )  # fmt: skip
        engine = PolicyEngine(model, settings, device=env.device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as gathered, engine.rollout_phase():
            rollout = engine.generate(encoded, seeds)
        with engine.rollout_phase():  # the same rows in the other order, in another batch
            backwards = engine.generate(encoded[::-1], seeds[::-1])
        with torch.profiler.profile(activities=activities) as plain, no_grad_pass(model):
            decoded = continue_prompts(
                model, encoded, pad_token_id=settings.pad_token_id,
                eos_token_id=settings.stop_token_ids, max_new_tokens=MAX_NEW_TOKENS,
                device=env.device, sampling=settings.sampling, seeds=seeds,
            )  # fmt: skip
        # The training forward's log-probabilities of the same tokens, at the same temperature
        batch = rollout.training_batch(settings.pad_token_id)
        chunking = LossChunking(64, transform=lambda logits: logits / TEMPERATURE)
        with no_grad_pass(model):
            scored = token_logprobs(model, batch, chunking=chunking, device=env.device)
        forced = [
            scored[b, len(p) - 1 : len(p) - 1 + len(c)].tolist()
            for b, (p, c) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids, strict=True))
        ]
        decode_steps = max(len(g.tokens) + int(g.eos) for g in decoded)
        mine_out = {
            f"{p}/{g}": {
                "completion": rollout.completion_ids[i],
                "reversed": backwards.completion_ids[len(mine) - 1 - i],
                "plain": decoded[i].tokens + ([decoded[i].stop_token] if decoded[i].eos else []),
                "logprobs": rollout.logprobs[i],
                "forced": forced[i],
                "truncated": rollout.truncated[i],
            }
            for i, (p, g) in enumerate(mine)
        }
        assert isinstance(rollout, Rollout)
        everything = dist_utils.all_gather_objects(
            {
                "rows": mine_out,
                "gathered_all_gathers": _all_gathers(gathered),
                "plain_all_gathers": _all_gathers(plain),
                "decode_steps": decode_steps,
            }
        )
        if env.is_main:
            result = {
                "world_size": env.world_size,
                "stop_tokens": list(stop_tokens(tokenizer)),
                "max_new_tokens": MAX_NEW_TOKENS,
                "shard_groups": len(fsdp_group_names(model)),
                "rows": {k: v for part in everything for k, v in part["rows"].items()},
                "ranks": [{k: v for k, v in part.items() if k != "rows"} for part in everything],
            }
            out.write_text(json.dumps(result))
        clean = True
    finally:
        del model
        gc.collect()
        dist_utils.destroy(synchronize=clean)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
