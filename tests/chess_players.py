"""Scripted stand-ins for a causal LM, for the chess evaluation's tests.

A `ScriptedPlayer` is an nn.Module with a causal LM's calling convention: on the first call
of a generation (no KV cache) it reads each row's prompt, asks `write(prompt_text)` for the
text to continue with, tokenises it with the real tokenizer, and then puts all probability on
the next planned token at every decoding step (its "cache" is the plan). Called on full
sequences without a cache (teacher forcing) it predicts each row's actual next token, like
an oracle, so next-move accuracy must come out at 100%.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import chess
import torch
from torch import nn

from fsdp_utils.chess_eval.referee import parse_uci


@dataclass
class Plan:
    tokens: list[list[int]]  # per row: the tokens still to write
    step: int = 0


class ScriptedPlayer(nn.Module):
    def __init__(self, tokenizer: Any, write: Callable[[str], tuple[str, bool]]) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.write = write
        self.weight = nn.Parameter(torch.zeros(1))  # a parameter, as a real model has
        self.forward_calls = 0

    def _logits_for(self, tokens: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(self.tokenizer))
        logits[tokens[0] if tokens else self.tokenizer.eos_token_id] = 1.0
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Plan | None = None,
        use_cache: bool = False,
        **_: Any,
    ) -> SimpleNamespace:
        self.forward_calls += 1
        vocab = len(self.tokenizer)
        if not use_cache:  # teacher forcing: the oracle predicts the actual next token
            logits = torch.zeros(*input_ids.shape, vocab)
            logits[:, :-1].scatter_(-1, input_ids[:, 1:, None], 1.0)
            return SimpleNamespace(logits=logits, past_key_values=None)
        if past_key_values is None:
            plans = []
            for row, mask in zip(input_ids, attention_mask, strict=True):
                prompt_ids = row[mask.bool()].tolist()
                prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
                text, eos = self.write(prompt)
                full = self.tokenizer(prompt + text, add_special_tokens=True)["input_ids"]
                if full[: len(prompt_ids)] == prompt_ids:
                    planned = full[len(prompt_ids) :]
                else:  # the text changes the prompt's last token (glued): write it apart
                    planned = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                planned += [self.tokenizer.eos_token_id] if eos else []
                plans.append(planned)
            past_key_values = Plan(plans)
        else:
            past_key_values.step += 1
        step = past_key_values.step
        logits = torch.stack([self._logits_for(p[step:]) for p in past_key_values.tokens])
        return SimpleNamespace(logits=logits[:, None, :], past_key_values=past_key_values)


def board_from_prompt(prompt: str) -> chess.Board:
    """Replay the UCI words of a rendered prompt (the header's words are not UCI)."""
    board = chess.Board()
    for word in prompt.split():
        move = parse_uci(word)
        if move is not None:
            board.push(move)
    return board


def legal_writer(plies: int, seed: int = 0) -> Callable[[str], tuple[str, bool]]:
    """Always a legal move (random, seeded by the prompt), EOS once the game is over."""

    def write(prompt: str) -> tuple[str, bool]:
        board = board_from_prompt(prompt)
        rng = random.Random(f"{seed}/{prompt}")
        words = []
        for _ in range(plies + 2):
            if board.is_game_over():
                return "".join(" " + w for w in words), True
            move = rng.choice(sorted(board.legal_moves, key=lambda m: m.uci()))
            words.append(move.uci())
            board.push(move)
        return "".join(" " + w for w in words), False

    return write


def fixed_writer(text: str, eos: bool = False) -> Callable[[str], tuple[str, bool]]:
    return lambda prompt: (text, eos)
