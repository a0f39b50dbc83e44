"""Requests per second of `python -m fsdp_utils.evaluate`'s model (`ShardedLM` over the FSDP2
model, one process) against lm-eval's own `HFLM` on the same model, on CPU.

    python bench/lm_eval_speed.py            # 3 interleaved rounds, medians and spreads
    python bench/lm_eval_speed.py --threads 1   # steadier on a shared machine
    python bench/lm_eval_speed.py --kinds loglikelihood_rolling --rounds 9 --documents 16

The requests are lm-eval `Instance`s as its tasks make them: multiple-choice log-likelihoods (a
question, four answers of a few words: ARC's shape) and rolling log-likelihoods of documents
(wikitext's), on a small random Llama (4 layers, 256 wide) with a byte-level tokenizer. Both sides
get the same requests and batch size; the time is the model call alone (tokenisation included,
task building not). Each round alternates which of the two goes first, so that a load that
drifts during a round does not always fall on the same side. On a machine other jobs load,
`--threads 1` gives far steadier figures: torch's intra-op threads wait for each other at every
operation, so one descheduled thread stalls the other, whichever side runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def make_requests(n_questions: int, n_documents: int, seed: int = 0) -> dict[str, list[Any]]:
    from lm_eval.api.instance import Instance

    from fsdp_utils.synthetic import random_words

    rng = random.Random(seed)
    choice = []
    for q in range(n_questions):
        context = f"Question: {random_words(rng, rng.randint(8, 30))}?\nAnswer:"
        for a in range(4):
            args = (context, " " + random_words(rng, rng.randint(1, 5)))
            choice.append(Instance("loglikelihood", {}, args, idx=a, metadata=("b", q, 1)))
    rolling = [
        Instance(
            "loglikelihood_rolling",
            {},
            (random_words(rng, rng.randint(200, 600)),),
            idx=0,
            metadata=("b", d, 1),
        )
        for d in range(n_documents)
    ]
    return {"loglikelihood": choice, "loglikelihood_rolling": rolling}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=["loglikelihood", "loglikelihood_rolling"],
        default=["loglikelihood", "loglikelihood_rolling"],
        help="which request kinds to time (the rolling ones alone take a few forwards a round)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)"
    )
    args = parser.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_utils.checkpoint.saved_model import (
        eval_config,
        load_sharded_model,
        resolve_model_source,
    )
    from fsdp_utils.lm_harness.sharded_lm import ShardedLM
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.synthetic import save_chat_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp(prefix="lm-eval-speed-")) / "model"
    save_chat_model(folder, "llama3", hidden_size=256, num_layers=4, max_positions=512)
    env = dist_utils.init_distributed("cpu")
    source = resolve_model_source(str(folder))
    sharded = load_sharded_model(source, eval_config(source, precision="fp32"), env)
    ours = ShardedLM(
        sharded,
        AutoTokenizer.from_pretrained(folder),
        device=env.device,
        batch_size=args.batch_size,
    )
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    hf = HFLM(
        pretrained=plain,
        tokenizer=AutoTokenizer.from_pretrained(folder),
        batch_size=args.batch_size,
        device="cpu",
    )
    everything = make_requests(args.questions, args.documents)
    requests = {kind: everything[kind] for kind in args.kinds}
    rates: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for kind, batch in requests.items():
            pair: list[tuple[str, Any]] = [("HFLM", hf), ("ShardedLM", ours)]
            for name, lm in pair if round_ % 2 == 0 else pair[::-1]:
                started = time.perf_counter()
                with torch.no_grad():
                    getattr(lm, kind)(batch, disable_tqdm=True)
                rates.setdefault((kind, name), []).append(
                    len(batch) / (time.perf_counter() - started)
                )
    print(
        f"requests/s on CPU, {torch.get_num_threads()} thread(s), {args.rounds} interleaved "
        "rounds (median, min-max):"
    )
    for kind in requests:
        medians = {}
        for name in ("HFLM", "ShardedLM"):
            values = rates[(kind, name)]
            medians[name] = statistics.median(values)
            print(
                f"  {kind:22s} {name:9s} {medians[name]:8.1f}  ({min(values):.1f}-{max(values):.1f})"
            )
        print(f"  {kind:22s} ratio     {medians['ShardedLM'] / medians['HFLM']:8.2f}")
    del ours, sharded
    dist_utils.destroy()


if __name__ == "__main__":
    main()
