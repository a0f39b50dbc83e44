"""Split attention against the unsplit model, every family, under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 tests/sequence_parallel_probe.py OUT.json [ARCH ...]

Every rank builds the same tiny model (fp32, eval: no dropout) and the same batch: two rows, an
answers-only mask on the first, packed documents (position ids restarting) on the second, a
length that 2 does not divide (so the last slice is padded). The unsplit loss and gradients are
the model's on the whole batch (no `sequence_parallel` keyword: the inner kernel); the split
ones are each rank's slice (`data.sequence_slices.slice_batch`) with the keyword, summed over
the ranks. Also each rule broken on purpose, to show that the comparison catches it: position
ids restarted per slice, labels shifted per slice, the per-rank mean losses averaged.
Rank 0 writes {case: {"loss": relative error, "grads": relative error, ...}} to OUT.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB, LENGTH, CHUNK = 96, 23, 7


def batch(packed: bool) -> dict[str, torch.Tensor]:
    from fsdp_utils.data.blocks import IGNORE_INDEX

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=gen)
    labels = ids.clone()
    labels[0, :9] = IGNORE_INDEX  # the prompt of an answers-only row
    out = {"input_ids": ids, "labels": labels}
    if packed:  # documents of 10 and 13 tokens in row 1, one across the slices' border
        positions = torch.arange(LENGTH).repeat(2, 1)
        positions[1, 10:] -= 10
        out["position_ids"] = positions
    return out


def build(arch: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from fsdp_utils.parallel.ulysses import use_split_attention
    from fsdp_utils.synthetic import tiny_model_config

    config = tiny_model_config(arch, VOCAB, hidden_size=32)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    use_split_attention(model)
    return model


def loss_and_grads(model, batch, **extra):
    from fsdp_utils.train.loss import LossChunking
    from fsdp_utils.train.step import forward_loss_sum

    model.zero_grad(set_to_none=True)
    chunking = LossChunking.build(CHUNK, model.config)
    _, loss = forward_loss_sum(
        model, batch, torch.device("cpu"), contextlib.nullcontext, chunking, **extra
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def summed(value: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(value)
    return value


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = torch.stack([(a[k] - b[k]).norm() for k in b]).norm()
    return float(diff / torch.stack([b[k].norm() for k in b]).norm())


def compare(model, whole, sp, *, slicer, mean_of_means: bool = False) -> dict[str, float]:
    """Relative errors of the split loss and gradients against the unsplit ones."""
    from fsdp_utils.train.loss import batch_targets

    loss, grads = loss_and_grads(model, whole)
    part = slicer(whole)
    split_loss, split_grads = loss_and_grads(model, part, **sp.forward_kwargs())
    targets = float(summed(torch.tensor(float(batch_targets(part)))))
    if mean_of_means:  # each rank's mean loss, averaged: wrong when the ranks' counts differ
        local = max(batch_targets(part), 1)
        split_loss = summed(split_loss / local) / sp.size * targets
        split_grads = {k: g / local / sp.size * targets for k, g in split_grads.items()}
    else:
        split_loss = summed(split_loss)
    split_grads = {k: summed(g) for k, g in split_grads.items()}
    return {
        "loss": float(abs(split_loss - loss) / loss),
        "grads": relative(split_grads, grads),
        "targets": targets,
        "whole_targets": batch_targets(whole),
    }


def main() -> int:
    from fsdp_utils.data.blocks import SHIFT_LABELS
    from fsdp_utils.data.sequence_slices import slice_batch
    from fsdp_utils.parallel import distributed as dist_utils
    from fsdp_utils.parallel.sequence import init_sequence_parallel
    from fsdp_utils.synthetic import TINY_ARCHITECTURES

    out, archs = Path(sys.argv[1]), sys.argv[2:] or list(TINY_ARCHITECTURES)
    torch.set_num_threads(1)
    env = dist_utils.init_distributed("cpu")
    sp = init_sequence_parallel(env, env.world_size)

    def right(b):
        return slice_batch(b, rank=sp.rank, size=sp.size)

    def local_positions(b):  # mistake: position ids restarted in each slice
        part = right(b)
        part["position_ids"] = part["position_ids"] - part["position_ids"][:, :1]
        return part

    def shifted_per_slice(b):  # mistake: each slice shifts its own labels
        part = right(b)
        labels = part["labels"]
        part[SHIFT_LABELS] = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
        return part

    results: dict[str, dict[str, float]] = {}
    for arch in archs:
        model = build(arch)
        for packed in (False, True):
            if packed and arch == "gpt_oss":  # its forward ignores packed position ids
                continue
            case = f"{arch} packed" if packed else arch
            results[case] = compare(model, batch(packed), sp, slicer=right)
    # Fewer key-value heads than ranks: each is repeated before the all-to-all.
    results["llama 1 kv head"] = compare(
        build("llama", num_key_value_heads=1), batch(True), sp, slicer=right
    )
    llama = build("llama")
    mistakes = {
        "mistake: positions per slice": {"slicer": local_positions},
        "mistake: labels shifted per slice": {"slicer": shifted_per_slice},
        "mistake: mean of the ranks' means": {"slicer": right, "mean_of_means": True},
    }
    for case, how in mistakes.items():
        results[case] = compare(llama, batch(True), sp, **how)  # type: ignore[arg-type]
    if env.is_main:
        out.write_text(json.dumps(results, indent=1))
    dist_utils.destroy(synchronize=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
