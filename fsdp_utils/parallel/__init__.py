"""Parallelism: process groups and devices (`distributed`), the data x sequence mesh of
`--sequence_parallel` (`sequence`) and its split attention (`ulysses`), then activation
checkpointing, `torch.compile` and FSDP2 (or DDP) applied to a meta model in one fixed order
(`parallelize`),
the model materialised and loaded (`materialize`), and decoding that is safe under FSDP, where
every forward is a collective (`generate`: the chess evaluation and the sample prompts).
"""
