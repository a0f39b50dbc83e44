"""The training configuration: one typed dataclass, the single source of truth.

The command line and config files (YAML or JSON) are thin layers over `TrainConfig`:
defaults < `--config FILE` < explicit command-line flags. The resolved config is written
to the run folder (`config.json`) so every run can be reproduced.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Precision = Literal["bf16-mixed", "fp16-mixed", "bf16-true", "fp32"]
Sharding = Literal["full", "shard_grad_op", "hybrid", "no_shard"]
OptimizerName = Literal["adamw", "sgd"]
LrSchedule = Literal["cosine", "linear", "constant"]
DeviceName = Literal["auto", "cuda", "cpu"]
ExportDtype = Literal["auto", "float32", "bfloat16", "float16"]
DataFormat = Literal[
    "auto", "chess", "text", "chat", "prompt_completion", "alpaca", "templates", "preference"
]
LongExamples = Literal["drop", "truncate", "error"]
Method = Literal["sft", "dpo"]
DpoLoss = Literal["sigmoid", "ipo"]
ReferenceMode = Literal["cached", "live"]
# transformers' names (`attn_implementation=`); what each can do: fsdp_utils/model/attention.py.
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flex_attention"]

DEFAULT_MODEL = "codellama/CodeLlama-7b-hf"
DEFAULT_DATASET = "laion/strategic_game_chess"
# laion/strategic_game_chess has hundreds of ~500 MB shards: by default one is enough.
DEFAULT_DATASET_INCLUDE = "chess_game_0001.parquet"
DEFAULT_TOTAL_BATCH_SIZE = 32
# The text a game becomes (see fsdp_utils.data.render). Fields: {result}, {termination}, {moves}.
DEFAULT_TEMPLATE = "[Result {result}] [Termination {termination}] {moves}"


def default_dataset_include(dataset: str) -> str | None:
    """The default chess dataset has hundreds of ~500 MB shards: never all of them by default."""
    return DEFAULT_DATASET_INCLUDE if dataset == DEFAULT_DATASET else None


# The sections of `--help`, in order: every field names one (`_opt(..., section=...)`).
SECTIONS = {
    "assets": "assets (from the offline cache)",
    "batch": "batch (the total batch is held fixed; accumulation is derived)",
    "optimizer": "optimizer and learning-rate schedule",
    "parallelism": "parallelism, precision and memory",
    "data": "data",
    "evaluation": "evaluation",
    "checkpoints": "run folder, checkpoints, time limits and the final model",
    "lora": "LoRA",
    "preference": "preference tuning (DPO: fsdp_utils/preference/)",
    "logging": "logging and trackers",
}


def _opt(help: str, *, section: str, **extra: Any) -> Any:
    """A field's metadata: its help, its `--help` section, and (`cli=`) argparse keywords for
    a flag of another shape than its type gives (an optional value, as lm-eval's flags)."""
    assert section in SECTIONS, section
    return {"help": help, "section": section, **extra}


def bool_text(text: str) -> bool:
    """A flag's optional true/false value (lm-eval's reading: true, 1 or yes is true)."""
    return text.strip().lower() in ("true", "1", "yes")


def bool_or_name(text: str) -> bool | str:
    """true/false as such, any other word as a name (`--eval_apply_chat_template [NAME]`)."""
    word = text.strip().lower()
    if word in ("true", "1", "yes", "false", "0", "no"):
        return bool_text(word)
    return text


@dataclass
class TrainConfig:
    # --- assets -------------------------------------------------------------------------
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_opt(
            "Hub id (resolved from the offline cache) or a local model folder.", section="assets"
        ),
    )
    dataset: str = field(
        default=DEFAULT_DATASET,
        metadata=_opt(
            "Hub dataset id (from the offline cache), a local folder, or files (.parquet, .json, "
            ".jsonl, .csv, .arrow). The format follows from the columns (--data_format). "
            "Comma-separate several files.",
            section="assets",
        ),
    )
    dataset_include: str | None = field(
        default=None,
        metadata=_opt(
            "Glob(s) of dataset files to use, comma-separated, e.g. "
            "'chess_game_000[1-2].parquet'. Default: the files download_models.py fetched for "
            "a hub dataset (every shard it recorded), all files of a local folder; an empty "
            "string: all data files.",
            section="assets",
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=_opt("Model revision (branch, tag or commit) in the cache.", section="assets"),
    )
    dataset_revision: str | None = field(
        default=None,
        metadata=_opt("Dataset revision (branch, tag or commit) in the cache.", section="assets"),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=_opt(
            "Hugging Face hub cache written by download_models.py (default: HF_HOME).",
            section="assets",
        ),
    )
    output_dir: str = field(
        default="runs/chess",
        metadata=_opt(
            "Run folder: config, metrics, checkpoints, final model, logs.", section="checkpoints"
        ),
    )

    # --- batch ---------------------------------------------------------------------------
    total_batch_size: int | None = field(
        default=None,
        metadata=_opt(
            "Sequences per optimizer step, held fixed whatever the number of GPUs: gradient "
            f"accumulation is derived from it (default {DEFAULT_TOTAL_BATCH_SIZE}).",
            section="batch",
        ),
    )
    batch_size_per_device: int = field(
        default=1,
        metadata=_opt("Sequences per forward/backward pass on each device.", section="batch"),
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata=_opt(
            "Micro-batches per optimizer step. Normally derived from --total_batch_size; "
            "if both are given they must agree.",
            section="batch",
        ),
    )
    max_seq_length: int = field(
        default=1024, metadata=_opt("Tokens per sequence (block).", section="batch")
    )

    # --- optimisation ----------------------------------------------------------------------
    learning_rate: float = field(
        default=2e-5, metadata=_opt("Peak learning rate.", section="optimizer")
    )
    optimizer: OptimizerName = field(
        default="adamw",
        metadata=_opt(
            "adamw (2 fp32 states per parameter) or sgd (none without momentum).",
            section="optimizer",
        ),
    )
    weight_decay: float = field(
        default=0.0, metadata=_opt("Decoupled weight decay.", section="optimizer")
    )
    momentum: float = field(
        default=0.0,
        metadata=_opt("SGD momentum (0 keeps SGD stateless: least memory).", section="optimizer"),
    )
    lr_schedule: LrSchedule = field(
        default="cosine",
        metadata=_opt(
            "Decay after linear warmup: cosine, linear or constant.", section="optimizer"
        ),
    )
    warmup_steps: int | None = field(
        default=None,
        metadata=_opt(
            "Linear warmup steps (default: 5% of max_training_steps).", section="optimizer"
        ),
    )
    min_lr_ratio: float = field(
        default=0.1,
        metadata=_opt("Final learning rate as a fraction of the peak.", section="optimizer"),
    )
    grad_clip: float = field(
        default=1.0,
        metadata=_opt("Clip the global gradient norm to this value (0: off).", section="optimizer"),
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata=_opt(
            "Mixture-of-experts models: weight of the routers' load-balancing loss added to the "
            "language-model loss and logged as aux_loss (0: off; default: the model config's "
            "router_aux_loss_coef if it sets output_router_logits, else off).",
            section="optimizer",
        ),
    )
    max_training_steps: int = field(
        default=100, metadata=_opt("Optimizer steps to run.", section="optimizer")
    )
    num_epochs: int | None = field(
        default=None,
        metadata=_opt(
            "Instead of --max_training_steps: passes over the prepared training blocks; the "
            "steps are epochs x (blocks // total batch), printed at start, the same on any "
            "number of GPUs.",
            section="optimizer",
        ),
    )
    seed: int = field(
        default=1234, metadata=_opt("Seed for model init, shuffling, dropout.", section="optimizer")
    )
    freeze_layers: int = field(
        default=0,
        metadata=_opt(
            "Freeze the embeddings and the first N decoder layers (llama-recipes' freeze_layers "
            "/ num_freeze_layers): they keep their pretrained weights and get no gradients, "
            "optimizer state or place in the checkpoints; the final model still holds them "
            "(0: train everything).",
            section="optimizer",
        ),
    )

    # --- parallelism and memory ----------------------------------------------------------
    no_fsdp: bool = field(
        default=False,
        metadata=_opt(
            "Plain data parallel (DDP): every device holds everything.", section="parallelism"
        ),
    )
    no_layer_wrap_policy: bool = field(
        default=False,
        metadata=_opt(
            "Shard only at the root (one FSDP group for the whole model).", section="parallelism"
        ),
    )
    sharding: Sharding = field(
        default="full",
        metadata=_opt(
            "full: shard params, grads, optimizer state; shard_grad_op: keep params gathered "
            "between forward and backward; hybrid: shard within a node, replicate across nodes; "
            "no_shard: replicate (DDP-like).",
            section="parallelism",
        ),
    )
    cpu_offload: bool = field(
        default=False,
        metadata=_opt(
            "Keep sharded params, grads and optimizer state in host RAM (FSDP2).",
            section="parallelism",
        ),
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata=_opt("Recompute decoder-layer activations in backward.", section="parallelism"),
    )
    checkpoint_every_n_layers: int = field(
        default=1,
        metadata=_opt(
            "With --gradient_checkpointing: checkpoint every Nth layer.", section="parallelism"
        ),
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata=_opt(
            "Target tokens per chunk of the loss: the output layer and cross-entropy run over "
            "chunks of this many tokens, each chunk's logits recomputed in backward, so the "
            "full [tokens, vocabulary] logits never exist (default: as many tokens as hold "
            "64 Mi logits, 523 for a 128,256-word vocabulary; 0: the whole batch at once).",
            section="parallelism",
        ),
    )
    defer_grad_sync: bool = field(
        default=False,
        metadata=_opt(
            "Reduce gradients only on the last micro-batch (less communication, but full "
            "unsharded gradients stay in memory).",
            section="parallelism",
        ),
    )
    precision: Precision = field(
        default="bf16-mixed",
        metadata=_opt(
            "bf16-mixed (fp32 master weights, bf16 compute), fp16-mixed (with a gradient "
            "scaler), bf16-true (everything bf16: least memory), fp32.",
            section="parallelism",
        ),
    )
    device: DeviceName = field(
        default="auto",
        metadata=_opt("cuda if available, else cpu (gloo backend).", section="parallelism"),
    )
    collective_timeout_minutes: float = field(
        default=30.0,
        metadata=_opt(
            "A collective (all-reduce, barrier, ...) that waits longer than this for a rank "
            "fails the run instead of hanging: a dead or frozen node ends the job. Raise it if "
            "the final save of a very large model takes longer (ranks wait for rank 0).",
            section="parallelism",
        ),
    )

    attn_implementation: AttnImplementation = field(
        default="sdpa",
        metadata=_opt(
            "transformers' attention implementation (llama-recipes' use_fast_kernels): sdpa "
            "(eager for models without it, as transformers does), eager, flash_attention_2 "
            "(CUDA and the flash-attn package), flex_attention. Checked before the job waits.",
            section="parallelism",
        ),
    )

    # --- compilation (step) --------------------------------------------------------------
    compile: bool = field(
        default=False,
        metadata=_opt(
            "torch.compile each decoder layer (after activation checkpointing, before FSDP), "
            "as torchtitan does; the first step is slower while it compiles.",
            section="parallelism",
        ),
    )

    # --- data ----------------------------------------------------------------------------
    template: str = field(
        default=DEFAULT_TEMPLATE,
        metadata=_opt(
            "How a chess game becomes text: {result}, {termination}, {moves}.", section="data"
        ),
    )
    text_field: str = field(
        default="text", metadata=_opt("Text column of plain-text datasets.", section="data")
    )
    data_format: DataFormat = field(
        default="auto",
        metadata=_opt(
            "auto: from the columns (Moves/Termination/Result: chess; messages or "
            "conversations: chat; prompt+completion; instruction+output: alpaca; text); or "
            "name one. templates: --prompt_template/--response_template over any columns.",
            section="data",
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_opt(
            "A Jinja chat template file to render chat rows with, instead of the tokenizer's "
            "own (needed for a model without one); the final model carries it.",
            section="data",
        ),
    )
    prompt_template: str | None = field(
        default=None,
        metadata=_opt(
            "The prompt of a row, with {column} placeholders, e.g. "
            "'Summarize this dialog:\\n{dialogue}\\n---\\nSummary:\\n' (with "
            "--response_template).",
            section="data",
        ),
    )
    response_template: str | None = field(
        default=None,
        metadata=_opt(
            "The answer of a row, with {column} placeholders, e.g. '{summary}'; the loss is "
            "on it and the EOS after it.",
            section="data",
        ),
    )
    dataset_module: str | None = field(
        default=None,
        metadata=_opt(
            "FILE.py:FUNCTION returning the rows (a datasets.Dataset or a list of dicts) in "
            "any format above, instead of --dataset; it runs wherever data is prepared.",
            section="data",
        ),
    )
    train_on_prompt: bool = field(
        default=False,
        metadata=_opt(
            "Chat, prompt/completion, alpaca, templates: train on every token, not only on "
            "the answers.",
            section="data",
        ),
    )
    long_examples: LongExamples = field(
        default="drop",
        metadata=_opt(
            "Chat, prompt/completion, alpaca, templates: a row longer than --max_seq_length "
            "is dropped, truncated (its start kept) or an error; counted in the log.",
            section="data",
        ),
    )
    no_packing: bool = field(
        default=False,
        metadata=_opt(
            "Pad each document to max_seq_length instead of packing full blocks.", section="data"
        ),
    )
    max_examples: int | None = field(
        default=None, metadata=_opt("Use at most this many documents (quick runs).", section="data")
    )
    eval_examples: int = field(
        default=200,
        metadata=_opt(
            "Documents held out for evaluation (0: no eval split).", section="evaluation"
        ),
    )
    eval_every: int = field(
        default=50,
        metadata=_opt(
            "Evaluate every N optimizer steps and at the end (0: end only).", section="evaluation"
        ),
    )
    eval_batches: int = field(
        default=20,
        metadata=_opt("At most this many batches per device per evaluation.", section="evaluation"),
    )
    eval_tasks: str | None = field(
        default=None,
        metadata=_opt(
            "lm-eval benchmarks to score the final model on at the end of the run, e.g. "
            "arc_easy,hellaswag (their data cached with download_models.py --eval_tasks); "
            "results in <output_dir>/lm_eval/.",
            section="evaluation",
        ),
    )
    eval_limit: int | None = field(
        default=None,
        metadata=_opt("With --eval_tasks: at most N documents per task.", section="evaluation"),
    )
    # --- --eval_tasks: lm-eval's prompt and generation options, its names with eval_ before
    # them (fsdp_utils/lm_harness/scoring.py reads them; docs/evaluate.md) ------------------
    eval_apply_chat_template: bool | str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --apply_chat_template [TEMPLATE_NAME], the prompts "
            "written through the final model's chat template. Default: on when the run "
            "trained on chat data (rows rendered with a chat template), else off; false: off.",
            section="evaluation",
            cli={"nargs": "?", "const": True, "type": bool_or_name, "metavar": "TEMPLATE_NAME"},
        ),
    )
    eval_fewshot_as_multiturn: bool | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --fewshot_as_multiturn [BOOL], the few-shot examples "
            "as chat turns (default: on with the chat template, which it needs).",
            section="evaluation",
            cli={"nargs": "?", "const": True, "type": bool_text, "metavar": "BOOL"},
        ),
    )
    eval_system_instruction: str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --system_instruction, a system message before every "
            "prompt.",
            section="evaluation",
        ),
    )
    eval_gen_kwargs: str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --gen_kwargs for every generation task, e.g. "
            "do_sample=True,temperature=0.7,top_p=0.95 (do_sample, temperature, top_p, top_k, "
            "until, max_gen_toks).",
            section="evaluation",
        ),
    )
    eval_seed: int | str | None = field(
        default=None,
        metadata=_opt(
            "With --eval_tasks: lm-eval's --seed, one number or python,numpy,torch,few-shot "
            "seeds (default 0,1234,1234,1234); the torch seed seeds sampling.",
            section="evaluation",
            cli={"type": str, "metavar": "N|A,B,C,D"},
        ),
    )
    num_proc: int | None = field(
        default=None,
        metadata=_opt("Tokenisation worker processes (default: CPUs, max 8).", section="data"),
    )
    data_cache_dir: str | None = field(
        default=None,
        metadata=_opt(
            "Where tokenised/packed data is cached (default: beside the hub cache).", section="data"
        ),
    )

    # --- chess evaluation and document masking --------------------------------------------
    document_masking: bool = field(
        default=False,
        metadata=_opt(
            "Packed documents do not attend to each other: position ids restart at every "
            "document (transformers then masks attention per document; sdpa, eager, flex).",
            section="data",
        ),
    )
    chess_eval_every: int = field(
        default=0,
        metadata=_opt(
            "Run the chess evaluation (legal-move rate, next-move accuracy) on held-out games "
            "every N optimizer steps and at the end (0: off).",
            section="evaluation",
        ),
    )
    chess_eval_games: int = field(
        default=32,
        metadata=_opt(
            "Held-out games per chess evaluation (3 continuations each).", section="evaluation"
        ),
    )
    chess_eval_plies: int = field(
        default=10,
        metadata=_opt("K: plies the model plays on from each game prefix.", section="evaluation"),
    )
    chess_eval_temperature: float = field(
        default=0.0,
        metadata=_opt(
            "Sampling temperature of the chess evaluation (0: greedy).", section="evaluation"
        ),
    )
    chess_eval_batch_size: int | None = field(
        default=None,
        metadata=_opt(
            "Sequences per forward pass in the chess evaluation (default: 8).", section="evaluation"
        ),
    )
    sample_prompts: str | None = field(
        default=None,
        metadata=_opt(
            "A jsonl file of prompts (chat `messages`, or a `prompt` string): at every evaluation "
            "the model answers each greedily, under FSDP, into output_dir/samples.jsonl and the "
            "log.",
            section="evaluation",
        ),
    )
    sample_max_new_tokens: int = field(
        default=64,
        metadata=_opt(
            "At most this many tokens per --sample_prompts answer (it ends earlier at EOS or the "
            "end-of-turn token).",
            section="evaluation",
        ),
    )

    # --- metrics -------------------------------------------------------------------------
    log_every: int = field(
        default=1, metadata=_opt("Log metrics every N optimizer steps.", section="logging")
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=_opt(
            "Peak TFLOP/s of one device for MFU (detected for A100/H100/H200).", section="logging"
        ),
    )

    profile_steps: str | None = field(
        default=None,
        metadata=_opt(
            "A:B: record optimizer steps A to B with the torch profiler, one trace per rank in "
            "output_dir/profile (Perfetto, TensorBoard); on CUDA also a memory snapshot "
            "(llama-recipes' use_profiler / profiler_dir).",
            section="logging",
        ),
    )
    flop_counter: bool = field(
        default=False,
        metadata=_opt(
            "Count the first step's FLOPs with torch's FlopCounterMode and log them beside the "
            "estimate that MFU uses (llama-recipes' flop_counter).",
            section="logging",
        ),
    )

    # --- trackers (fsdp_utils.metrics.trackers) ----------------------------------------------------
    tensorboard: bool = field(
        default=False,
        metadata=_opt(
            "Also write the metrics as TensorBoard event files into output_dir/tensorboard "
            "(view on the login node: tensorboard --logdir runs/).",
            section="logging",
        ),
    )
    wandb: str | None = field(
        default=None,
        metadata=_opt(
            "Also log to this W&B project, always offline, into output_dir/wandb (no network "
            "call; the end of the log gives the `wandb sync` command for the login node). "
            "Needs pip install -e '.[wandb]'.",
            section="logging",
        ),
    )

    # --- checkpoints and time limits -----------------------------------------------------
    save_every_steps: int = field(
        default=0,
        metadata=_opt("Save a sharded checkpoint every N steps (0: off).", section="checkpoints"),
    )
    save_every_minutes: float = field(
        default=30.0,
        metadata=_opt("Save a sharded checkpoint every M minutes (0: off).", section="checkpoints"),
    )
    keep_last: int = field(
        default=2, metadata=_opt("Checkpoints to keep (older are deleted).", section="checkpoints")
    )
    resume: str = field(
        default="auto",
        metadata=_opt(
            "auto: continue from the newest complete checkpoint in output_dir if there is one; "
            "never: start fresh (the previous run moves to output_dir/previous-<time>/); or a "
            "checkpoint folder. A requeued job's later legs always resume their own newest.",
            section="checkpoints",
        ),
    )
    time_limit_margin_minutes: float | None = field(
        default=None,
        metadata=_opt(
            "Save and stop this long before the Slurm job ends (default: estimated from the "
            "measured save time, at least 2 minutes).",
            section="checkpoints",
        ),
    )
    stop_file: str | None = field(
        default=None,
        metadata=_opt(
            "Save and stop at the next step boundary once this file exists (the sbatch "
            "script creates it when Slurm signals the job; default: output_dir/STOP).",
            section="checkpoints",
        ),
    )
    stop_after_steps: int | None = field(
        default=None,
        metadata=_opt(
            "Save and stop after this many steps in this run, as if the time limit had come "
            "(split a long run into shorter jobs; the next run resumes).",
            section="checkpoints",
        ),
    )
    no_final_save: bool = field(
        default=False,
        metadata=_opt("Do not write the Hugging Face model at the end.", section="checkpoints"),
    )

    # --- preference tuning (fsdp_utils/preference/) -------------------------------------------
    method: Method = field(
        default="sft",
        metadata=_opt(
            "sft: supervised fine-tuning (the loss on the answers); dpo: Direct Preference "
            "Optimization on pairs of a chosen and a rejected answer (columns chosen, rejected "
            "and optionally prompt; docs/preference.md). With dpo the batch sizes count pairs.",
            section="preference",
        ),
    )
    dpo_beta: float = field(
        default=0.1,
        metadata=_opt(
            "DPO's beta: how far the policy may move from the reference (higher: less).",
            section="preference",
        ),
    )
    dpo_loss: DpoLoss = field(
        default="sigmoid",
        metadata=_opt(
            "sigmoid: DPO's loss; ipo: IPO's squared loss on length-averaged log-probabilities "
            "(TRL's loss_type names).",
            section="preference",
        ),
    )
    dpo_label_smoothing: float = field(
        default=0.0,
        metadata=_opt(
            "With --dpo_loss sigmoid: the assumed fraction of pairs whose labels are flipped "
            "(conservative DPO); 0: plain DPO.",
            section="preference",
        ),
    )
    reference: ReferenceMode = field(
        default="cached",
        metadata=_opt(
            "The DPO reference model without --lora: cached (its log-probabilities computed "
            "once before training, sharded, and kept beside the prepared data) or live (a "
            "frozen sharded copy of the model, run at every step: one more forward per step, "
            "one more model in memory). With --lora the reference is the model with its "
            "adapters off.",
            section="preference",
        ),
    )

    # --- LoRA (fsdp_utils/model/lora.py) -----------------------------------------------------------
    lora: bool = field(
        default=False,
        metadata=_opt(
            "Train LoRA adapters (peft) instead of the whole model: the base stays frozen in the "
            "compute dtype; checkpoints hold the adapters only; the final model is a PEFT "
            "adapter folder.",
            section="lora",
        ),
    )
    lora_r: int = field(default=8, metadata=_opt("LoRA rank.", section="lora"))
    lora_alpha: int = field(
        default=16, metadata=_opt("LoRA alpha: the update is scaled by alpha / r.", section="lora")
    )
    lora_dropout: float = field(
        default=0.05, metadata=_opt("Dropout on the adapters' input (0: none).", section="lora")
    )
    lora_target_modules: str | None = field(
        default=None,
        metadata=_opt(
            "Comma-separated linear layers of the decoder layers to adapt, e.g. q_proj,v_proj; "
            "mixture-of-experts models also take their fused expert tensors (gate_up_proj, "
            "down_proj, or experts for both; needs --lora_dropout 0). Default: every linear "
            "layer of the decoder layers outside mixture-of-experts blocks.",
            section="lora",
        ),
    )
    lora_dora: bool = field(
        default=False,
        metadata=_opt(
            "With --lora: DoRA (weight-decomposed LoRA, peft's use_dora): a trained magnitude "
            "per output feature on top of the low-rank direction update.",
            section="lora",
        ),
    )
    lora_from: str | None = field(
        default=None,
        metadata=_opt(
            "With --lora: continue training this PEFT LoRA adapter (llama-recipes' "
            "from_peft_checkpoint), a local folder or a hub id in the offline cache "
            "(download_models.py --model ID). Its rank, alpha, targets and DoRA setting win "
            "over the --lora_* flags.",
            section="lora",
        ),
    )
    merge: bool = field(
        default=False,
        metadata=_opt(
            "With --lora: also write the base model with the adapters merged in "
            "(output_dir/final_merged), loadable without peft.",
            section="lora",
        ),
    )

    # --- export ----------------------------------------------------------------------------
    export_dtype: ExportDtype = field(
        default="auto",
        metadata=_opt(
            "dtype of the final model's weights: auto (the source model's, from its "
            "config.json), float32, bfloat16 or float16.",
            section="checkpoints",
        ),
    )

    @property
    def resolved_dataset_include(self) -> str | None:
        """The file glob to download (download_models.py --config); None means all files. The
        trainer reads `dataset_include` itself: None there means what was downloaded."""
        if self.dataset_include is not None:
            return self.dataset_include or None
        return default_dataset_include(self.dataset)

    @property
    def profile_step_range(self) -> tuple[int, int] | None:
        """--profile_steps A:B as (A, B), optimizer steps counted from 1; None when off."""
        if self.profile_steps is None:
            return None
        return parse_step_range(self.profile_steps)

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(0.05 * self.max_training_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def parse_step_range(text: str) -> tuple[int, int]:
    """'3:5' -> (3, 5); '4' -> (4, 4). Steps count from 1."""
    first, sep, last = text.partition(":")
    try:
        start, end = int(first), int(last if sep else first)
    except ValueError:
        start = end = 0
    if not 1 <= start <= end:
        raise ValueError(
            f"--profile_steps {text!r}: give the first and last optimizer step to record as "
            "A:B with 1 <= A <= B, e.g. --profile_steps 3:5 (the first steps are slower: "
            "start after them)."
        )
    return start, end


# lm-eval's options for --eval_tasks (their reading: fsdp_utils/lm_harness/scoring.py).
EVAL_SCORING_FIELDS = (
    "eval_apply_chat_template",
    "eval_fewshot_as_multiturn",
    "eval_system_instruction",
    "eval_gen_kwargs",
    "eval_seed",
)


def validate_config(config: TrainConfig) -> None:
    """Checks that need no model, data or world size (those come in the batch plan)."""
    positive = ["batch_size_per_device", "max_seq_length", "max_training_steps", "log_every"]
    positive += ["checkpoint_every_n_layers", "sample_max_new_tokens"]
    for name in positive:
        if getattr(config, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(config, name)}.")
    if config.eval_limit is not None and not config.eval_tasks:
        raise ValueError("--eval_limit limits --eval_tasks: give --eval_tasks too.")
    for name in EVAL_SCORING_FIELDS:
        if getattr(config, name) is not None and not config.eval_tasks:
            raise ValueError(f"--{name} says how --eval_tasks scores: give --eval_tasks too.")
    for name in ("total_batch_size", "gradient_accumulation_steps", "eval_limit"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}.")
    if config.loss_chunk_size is not None and config.loss_chunk_size < 0:
        raise ValueError(
            f"--loss_chunk_size must be >= 0 (0: unchunked), got {config.loss_chunk_size}."
        )
    if config.collective_timeout_minutes <= 0:
        raise ValueError(
            "--collective_timeout_minutes must be positive, got "
            f"{config.collective_timeout_minutes}."
        )
    if config.learning_rate <= 0:
        raise ValueError(f"--learning_rate must be positive, got {config.learning_rate}.")
    warmup = config.warmup_steps
    if config.num_epochs is not None and config.num_epochs < 1:
        raise ValueError(f"--num_epochs must be at least 1, got {config.num_epochs}.")
    # With --num_epochs the steps are known once the data is prepared; checked again then.
    steps_known = config.num_epochs is None
    if (
        steps_known
        and warmup is not None
        and (warmup < 0 or (warmup > 0 and warmup >= config.max_training_steps))
    ):
        raise ValueError(
            f"--warmup_steps ({warmup}) must be between 0 and "
            f"--max_training_steps - 1 ({config.max_training_steps - 1})."
        )
    if not 0.0 <= config.min_lr_ratio <= 1.0:
        raise ValueError(f"--min_lr_ratio must be in [0, 1], got {config.min_lr_ratio}.")
    if config.grad_clip < 0:
        raise ValueError(f"--grad_clip must be >= 0 (0 disables clipping), got {config.grad_clip}.")
    if config.no_fsdp and (config.no_layer_wrap_policy or config.cpu_offload):
        raise ValueError(
            "--no_fsdp (DDP) cannot be combined with --no_layer_wrap_policy or --cpu_offload, "
            "which are FSDP options."
        )
    if config.no_fsdp and config.sharding != "full":
        raise ValueError("--no_fsdp (DDP) cannot be combined with --sharding.")
    if config.chess_eval_plies < 1:
        raise ValueError(
            f"--chess_eval_plies (K, the plies each continuation is judged for) must be at "
            f"least 1, got {config.chess_eval_plies}."
        )
    for name in ("chess_eval_every", "chess_eval_games", "chess_eval_batch_size"):
        value = getattr(config, name)
        if value is not None and value < (0 if name == "chess_eval_every" else 1):
            raise ValueError(
                f"--{name} must be at least {int(name != 'chess_eval_every')}, got {value}."
            )
    if config.chess_eval_temperature < 0:
        raise ValueError(
            f"--chess_eval_temperature must be >= 0 (0: greedy), got {config.chess_eval_temperature}."
        )
    _validate_lora(config)
    _validate_preference(config)
    if config.freeze_layers < 0:
        raise ValueError(f"--freeze_layers must be >= 0 (0: off), got {config.freeze_layers}.")
    if config.freeze_layers and config.lora:
        raise ValueError(
            "--freeze_layers with --lora: LoRA already freezes every pretrained weight. To "
            "adapt only some layers' projections use --lora_target_modules; to train the top "
            "layers fully, drop --lora."
        )
    _ = config.profile_step_range  # a malformed --profile_steps fails here
    _validate_data_format(config)
    for field_name in ("{moves}",):
        if field_name not in config.template:
            raise ValueError(f"--template must contain {field_name}: got {config.template!r}.")


def _validate_data_format(config: TrainConfig) -> None:
    templates = (config.prompt_template, config.response_template)
    if (templates[0] is None) != (templates[1] is None):
        raise ValueError(
            "--prompt_template and --response_template go together: the prompt carries no "
            "loss, the response does. Give both, e.g. --prompt_template "
            "$'Summarize this dialog:\\n{dialogue}\\n---\\nSummary:\\n' "
            "--response_template '{summary}'."
        )
    if templates[0] is not None and config.data_format not in ("auto", "templates"):
        raise ValueError(
            f"--prompt_template/--response_template make the format `templates`, but "
            f"--data_format is {config.data_format}: drop one of them."
        )
    if config.data_format == "templates" and templates[0] is None:
        raise ValueError(
            "--data_format templates needs --prompt_template and --response_template, "
            "strings with {column} placeholders."
        )
    module = config.dataset_module
    if module is not None and (":" not in module or not module.rsplit(":", 1)[1].isidentifier()):
        raise ValueError(
            f"--dataset_module {module!r}: expected FILE.py:FUNCTION, e.g. my_data.py:build."
        )


def _validate_preference(config: TrainConfig) -> None:
    if config.method != "dpo":
        changed = [
            f"--{f.name}"
            for f in dataclasses.fields(config)
            if f.metadata.get("section") == "preference"
            and f.name != "method"
            and getattr(config, f.name) != f.default
        ]
        if changed:
            raise ValueError(
                f"{', '.join(changed)}: preference-tuning option(s), which only --method dpo "
                "reads. Add --method dpo (and a dataset of chosen/rejected pairs), or drop them."
            )
        return
    if config.dpo_beta <= 0:
        raise ValueError(f"--dpo_beta must be positive, got {config.dpo_beta}.")
    if not 0.0 <= config.dpo_label_smoothing < 0.5:
        raise ValueError(
            f"--dpo_label_smoothing must be in [0, 0.5), got {config.dpo_label_smoothing}."
        )
    if config.dpo_label_smoothing and config.dpo_loss != "sigmoid":
        raise ValueError("--dpo_label_smoothing applies to --dpo_loss sigmoid only.")
    if config.reference == "live" and config.lora:
        raise ValueError(
            "--reference live keeps a frozen copy of the model as the DPO reference, but with "
            "--lora the reference is already the same model with its adapters off (no second "
            "model in memory). Drop --reference live."
        )
    if config.train_on_prompt:
        raise ValueError(
            "--train_on_prompt with --method dpo: DPO compares the answers given the same "
            "prompt, so the prompt's tokens carry no loss. Drop --train_on_prompt."
        )


def _validate_lora(config: TrainConfig) -> None:
    if config.merge and not config.lora:
        raise ValueError(
            "--merge writes the base model with the LoRA adapters merged in: it needs --lora "
            "(a full fine-tune's final model is already a complete model)."
        )
    if config.lora and (config.lora_r < 1 or config.lora_alpha <= 0):
        raise ValueError(
            f"--lora_r must be at least 1 and --lora_alpha positive, got {config.lora_r} and "
            f"{config.lora_alpha}."
        )
    if config.lora and not 0.0 <= config.lora_dropout < 1.0:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {config.lora_dropout}.")
    for name in ("lora_dora", "lora_from"):
        if getattr(config, name) and not config.lora:
            raise ValueError(f"--{name} is a LoRA option: add --lora.")
