"""Standard benchmarks (lm-evaluation-harness) on the model sharded as training shards it.

    sharded_lm   `ShardedLM`: lm-eval's model interface over the FSDP2 model; requests split
                 across the ranks, the same number of forward passes on each
    loading      what `--model` names (hub id, model folder, run folder, LoRA adapter) ->
                 the model built on meta, sharded with FSDP2, loaded slice by slice
    tasks        the tasks' datasets from the offline cache (lm-eval's YAMLs, unchanged,
                 reading the pinned snapshots)
    cli          `python -m fsdp_utils.evaluate`

See docs/evaluate.md.
"""
