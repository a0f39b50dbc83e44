"""Data: dataset files -> rows -> tokens (and loss masks) -> packed blocks -> each step's batches.

`files` knows the file types (.parquet/.json/.jsonl/.csv/.arrow) and `streaming` reads their rows
in batches (or a `--dataset_module`'s rows: `custom`); `formats` chooses the format from the columns; `render`
turns chess games into text; `chat` (chat templates, assistant-only masks), `instruct`
(prompt/completion, alpaca, `{column}` templates) and `rows` (long rows, drops) turn the other
formats into tokens and loss masks; `packing` cuts streams into blocks or packs whole rows;
`prepare` orchestrates and caches it all on disk under a key of everything that determines it,
tokenising in forked processes (`workers`), spilling tokens and writing blocks as they come
(`token_files`), and `cli` runs it alone
(`python -m fsdp_utils.data`, slurm/prepare.sh);
`blocks` reads the prepared blocks at training time and decides which blocks every rank sees at
every step (a pure function of the step), and `--num_epochs` into steps; `document_masking`
keeps packed documents from attending to each other. `preference` turns TRL's preference rows
(chosen/rejected, --method dpo) into pairs of masked sequences and reads back whole pairs.
"""
