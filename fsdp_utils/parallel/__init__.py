"""Parallelism: process groups and devices (`distributed`), then activation checkpointing,
`torch.compile` and FSDP2 (or DDP) applied to a meta model in one fixed order (`parallelize`).
"""
