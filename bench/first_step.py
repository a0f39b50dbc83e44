"""What the first optimizer step of an FSDP2 run costs by depth: DTensor works out a sharding
rule for each of AdamW's foreach ops over the list of every parameter, once per process (every
rank of every job leg pays it; later steps reuse the rules). torch 2.13 fixes up each listed
tensor's rule against the whole list (`_propagate_use_strided_shard_flag`, new since 2.11), so
the cost grows with the square of the number of parameters.

    python bench/first_step.py                          # 8, 32 and 80 layers, foreach and fused
    python bench/first_step.py --layers 80 --json bench/results/first_step.json
    .venv-device/bin/python bench/first_step.py         # the same at the lent GPU's torch 2.11

One process per row: a tiny Llama (hidden size 64: what counts is the number of tensors, not
their size) of N decoder layers, FSDP2 per layer on one CPU process (gloo), one forward and
backward, then the CPU seconds of the first and the second `optimizer.step()`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

layers, implementation = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port: 1 rank
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
    num_attention_heads=4, num_key_value_heads=2))
mesh = init_device_mesh("cpu", (1,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **{implementation: True})
tokens = torch.randint(0, 512, (2, 32))
seconds = []
for _ in range(2):
    model(input_ids=tokens, labels=tokens).loss.backward()
    start = time.process_time()
    optimizer.step()
    seconds.append(time.process_time() - start)
    optimizer.zero_grad()
dist.destroy_process_group()
print(json.dumps({"parameters": len(list(model.parameters())), "first_s": seconds[0],
                  "second_s": seconds[1], "torch": torch.__version__}))
"""


def measure(layers: int, implementation: str) -> dict[str, float | str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(layers), implementation],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"the probe failed:\n{result.stderr[-3000:]}")
    row: dict[str, float | str] = json.loads(result.stdout.strip().splitlines()[-1])
    return {"layers": layers, "implementation": implementation, **row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="8,32,80", help="depths, comma-separated")
    parser.add_argument("--implementations", default="foreach,fused")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        for implementation in args.implementations.split(","):
            row = measure(layers, implementation)
            rows.append(row)
            print(
                f"torch {row['torch']}: {layers} layers ({row['parameters']} tensors), "
                f"{implementation}: first step {row['first_s']:.2f} s of CPU, "
                f"second {row['second_s']:.3f} s",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
