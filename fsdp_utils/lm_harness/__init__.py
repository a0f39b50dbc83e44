"""Standard benchmarks (lm-evaluation-harness) on the model sharded as training shards it.

    sharded_lm   `ShardedLM`: lm-eval's model interface over the FSDP2 model; requests dealt
                 to the ranks, the same number of forward passes on each
    loading      what `--model` names (hub id, model folder, run folder, LoRA adapter) ->
                 the model built on meta, sharded with FSDP2, loaded slice by slice
    tasks        the tasks' datasets from the offline cache (lm-eval's YAMLs, unchanged,
                 reading the pinned snapshots)
    task_cache   the login node's half: `download_models.py --eval_tasks`, and its offline check
    scoring      lm-eval's prompt and generation options (--apply_chat_template,
                 --fewshot_as_multiturn, --system_instruction, --gen_kwargs, --seed) and the
                 record of how a results file was scored
    compare      `--compare BASE_RESULTS`: base against fine-tuned, with standard errors (two
                 results scored different ways are refused)
    compare_plot `python -m fsdp_utils.plot --compare BASE RESULTS`: that comparison drawn
    training     `chess_finetune.py --eval_tasks`: the final model scored at the end of the run
                 (through its chat template when the run trained on chat data)
    cli          `python -m fsdp_utils.evaluate`

See docs/evaluate.md.
"""
