"""Metrics: what a run reports and how people read it.

`logger` is rank 0's log (metrics.jsonl + console) and its one reader; `throughput` counts
FLOPs, MFU and memory; `trackers` mirror the log to TensorBoard and W&B (offline);
`plot` draws the curves of runs and sweeps (`python -m fsdp_utils.plot`).
"""
