"""Load Hub-layout mixture-of-experts checkpoints into FSDP2 shards on 2 real processes.

    torchrun --nproc_per_node 2 tests/fused_load_probe.py OUT.json FOLDER...

For each model folder: the meta build, `fully_shard` per decoder layer (fused expert tensors on
dim 0, FSDP2's default, or on dim 1 when the folder name ends in `-dim1`: a shard that splits
inside each expert), `to_empty`, and the loader. Each rank records how many elements it read for
the fused tensors and how many its shards hold; rank 0 gathers the loaded model and compares it
with `from_pretrained`. The test reads OUT.json.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_utils.parallel.distributed import destroy

    dist.init_process_group("gloo")
    results = _load_each(init_device_mesh("cpu", (dist.get_world_size(),)), sys.argv[2:])
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=2))
    # All ranks end together, the models and the mesh freed first: rank 1, done first while
    # rank 0 compares with from_pretrained, must not tear gloo down under it, nor keep a group
    # alive past its peer (either aborts a rank at exit: see distributed.destroy).
    gc.collect()
    destroy(synchronize=True)
    return 0


def _load_each(mesh: Any, folders: list[str]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    from fsdp_utils.hub.resolve import load_model_config
    from fsdp_utils.model.build import build_meta_model, find_decoder_layers, materialize
    from fsdp_utils.model.fused_weights import FusedTensor, load_fused_tensors, local_block
    from fsdp_utils.model.weights import checkpoint_key_map, load_pretrained_weights

    rank = dist.get_rank()
    results = {}
    for folder in map(Path, folders):
        dim = 1 if folder.name.endswith("-dim1") else 0
        model = build_meta_model(load_model_config(folder), "fp32")
        key_map = checkpoint_key_map(model, folder)
        fused = {k: v for k, v in key_map.items() if isinstance(v, FusedTensor)}
        for layer in find_decoder_layers(model):
            # The fused expert tensors (3-D) on `dim`, everything else on dim 0.
            place = lambda p, d=dim: Shard(d if p.dim() == 3 else 0)  # noqa: E731
            fully_shard(layer, mesh=mesh, shard_placement_fn=place)
        fully_shard(model, mesh=mesh)
        materialize(model, torch.device("cpu"))
        load_pretrained_weights(model, folder, key_map)
        params = dict(model.named_parameters())
        held = sum(local_block(params[key])[0].numel() for key in fused)
        read = load_fused_tensors(model, folder, fused)  # again, to count what it reads
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, (read, held))
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            reference = AutoModelForCausalLM.from_pretrained(folder).state_dict()
            results[folder.name] = {
                "fused": sorted(fused),
                "counts": counts,
                "full": sum(reference[k].numel() for k in fused),
                "different": [k for k, v in reference.items() if not torch.equal(state[k], v)],
            }
    return results


if __name__ == "__main__":
    raise SystemExit(main())
