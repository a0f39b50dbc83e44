"""Tiny, fully local stand-ins for the real assets: chess games, a tokenizer and small models.

`make demo` and the tests use them so that nothing is ever fetched from the Hub:
- random legal chess games (the `chess` package) written as parquet shards in the schema of
  `laion/strategic_game_chess` (`Moves`, `Termination`, `Result`, files `chess_game_NNNN.parquet`);
- a BPE tokenizer trained with `tokenizers` on the rendered games;
- small models of every dense family we support (Llama, Qwen2, Qwen3, Mistral, Gemma 1-3,
  Phi-3, OLMo 2, Granite, GPT-2, GPT-NeoX), built with transformers' own config classes and saved
  with `save_pretrained` as safetensors, and mixture-of-experts ones (Mixtral, Qwen3-MoE,
  Qwen2-MoE, OLMoE, gpt-oss).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fsdp_utils.config.train_config import DEFAULT_TEMPLATE
from fsdp_utils.data.chess_files import write_chess_shards
from fsdp_utils.data.render import render_row

SPECIAL_TOKENS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}
# Dense families (see docs/models.md): the first six since the start, then issue 23's.
TINY_DENSE_ARCHITECTURES: tuple[str, ...] = (
    "llama", "qwen2", "mistral", "gemma", "gpt2", "gpt_neox",
    "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite",
)  # fmt: skip
# Mixture-of-experts families (4 experts, 2 per token), saved by `save_pretrained` in the Hub's
# layout: one tensor per expert (gpt-oss: fused, as its bf16 checkpoints are).
TINY_MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss")
TINY_ARCHITECTURES = TINY_DENSE_ARCHITECTURES + TINY_MOE_ARCHITECTURES


# --- games ---------------------------------------------------------------------------------


def random_game(rng: random.Random, capture_bias: float = 0.7) -> dict[str, Any]:
    """Play one random legal game to its end.

    Captures are preferred with probability `capture_bias`: purely random games last ~330 plies
    and need slow draw-claim checks; capture-biased ones end (mostly by insufficient material)
    in ~180 plies, about 8x faster to generate, which keeps `make demo` short.
    """
    import chess

    board = chess.Board()
    while True:
        moves = list(board.legal_moves)
        if (outcome := _outcome(board, moves)) is not None:
            break
        captures = [m for m in moves if board.is_capture(m)]
        pool = captures if captures and rng.random() < capture_bias else moves
        board.push(rng.choice(pool))
    return {
        "Moves": [m.uci() for m in board.move_stack],
        "Termination": outcome.termination.name,
        "Result": outcome.result(),
    }


def _outcome(board: Any, moves: list[Any]) -> Any:
    """`board.outcome()` of a standard board whose legal moves are `moves`, in its order of
    checks: the same answer without generating the legal moves a second and third time (a
    third of the games' CPU; every test session builds 400 games)."""
    import chess

    if not moves and board.is_check():
        return chess.Outcome(chess.Termination.CHECKMATE, not board.turn)
    if board.is_insufficient_material():
        return chess.Outcome(chess.Termination.INSUFFICIENT_MATERIAL, None)
    if not moves:
        return chess.Outcome(chess.Termination.STALEMATE, None)
    if board.halfmove_clock >= 150:  # is_seventyfive_moves(): 150 half-moves and a legal move
        return chess.Outcome(chess.Termination.SEVENTYFIVE_MOVES, None)
    if board.is_fivefold_repetition():
        return chess.Outcome(chess.Termination.FIVEFOLD_REPETITION, None)
    return None


def random_games(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_game(rng) for _ in range(n)]


# --- tokenizer -----------------------------------------------------------------------------


def train_chess_tokenizer(texts: list[str], vocab_size: int = 512) -> Any:
    """A byte-level-free BPE tokenizer over whitespace-split chess text, as a transformers
    `PreTrainedTokenizerFast` with <s>, </s>, <pad>, <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    tokenizer.model = models.BPE(unk_token=SPECIAL_TOKENS["unk_token"], end_of_word_suffix="</w>")
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer = Tokenizer.from_str(canonical_ids(tokenizer.to_str(), suffix="</w>"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def uci_moves() -> list[str]:
    """Every move UCI can write in standard chess (1,968: a queen's or a knight's move from
    each square, and the pawns' promotions), in python-chess's square order."""
    import chess

    moves: set[str] = set()
    for square in chess.SQUARES:
        for piece in (chess.QUEEN, chess.KNIGHT):
            board = chess.BaseBoard.empty()
            board.set_piece_at(square, chess.Piece(piece, chess.WHITE))
            moves.update(chess.Move(square, to).uci() for to in board.attacks(square))
    for file in range(8):
        for to_file in (file - 1, file, file + 1):
            if not 0 <= to_file < 8:
                continue
            # White's seventh rank to the eighth, Black's second to the first.
            for start, end in ((6, 7), (1, 0)):
                for promotion in (chess.QUEEN, chess.ROOK, chess.BISHOP, chess.KNIGHT):
                    from_square, to_square = chess.square(file, start), chess.square(to_file, end)
                    moves.add(chess.Move(from_square, to_square, promotion).uci())
    return sorted(moves, key=lambda m: (chess.parse_square(m[:2]), m))


def uci_tokenizer(template: str = DEFAULT_TEMPLATE) -> Any:
    """A word-level tokenizer with one token per UCI move (all 1,968 of them, `uci_moves`) and
    per word of the template's header (`[Result`, `1-0]`, `[Termination`, `CHECKMATE]`, ...),
    as a transformers `PreTrainedTokenizerFast` with <s>, </s>, <pad>, <unk>. Every move is one
    token, so the model's next-token distribution is a distribution over moves: a masked move
    (the most likely legal one) costs one forward pass, and a game of 90 plies is 90 tokens."""
    import chess
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS.values())
    for result in ("1-0", "0-1", "1/2-1/2", "*"):
        for termination in [t.name for t in chess.Termination]:
            rendered = template.split("{moves}", 1)[0].format(
                result=result, termination=termination, moves=""
            )
            words.extend(w for w in rendered.split() if w not in words)
    words.extend(uci_moves())
    vocab = {word: i for i, word in enumerate(dict.fromkeys(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def canonical_ids(spec: str, *, suffix: str) -> str:
    """A trained BPE tokenizer (tokenizer.json's text) with its ids in an order that follows
    from its tokens and merges alone: the special tokens, the alphabet (plain characters, then
    the word-final ones, `x</w>`, each sorted), then each merge's token in merge order.

    tokenizers' BpeTrainer numbers the word-final characters as it meets them while walking a
    hash map of the words, whose order is random in each process: the same texts gave another
    id to `1</w>`, `b</w>`, ... in every process, so a seeded tiny model (its embedding rows
    taken by index) learned from a differently permuted vocabulary each time, and a test's
    held-out loss moved by more than its margin between runs."""
    data = json.loads(spec)
    vocab: dict[str, int] = data["model"]["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]]
    special = sorted((t["id"], t["content"]) for t in data["added_tokens"])
    products = list(dict.fromkeys(a + b for a, b in merges))
    taken = {token for _, token in special} | set(products)
    alphabet = sorted((t for t in vocab if t not in taken), key=lambda t: (t.endswith(suffix), t))
    order = [token for _, token in special] + alphabet + products
    assert sorted(order) == sorted(vocab), "every token once"
    data["model"]["vocab"] = {token: i for i, token in enumerate(order)}
    for added in data["added_tokens"]:
        added["id"] = data["model"]["vocab"][added["content"]]
    return json.dumps(data)


# --- models --------------------------------------------------------------------------------


# Tokens: shorter than the tests' 64-token blocks, so that sliding-window layers do slide.
SLIDING_WINDOW = 16


def _defaults(head_dim: int, layers: int) -> dict[str, Any]:
    return {}


def _head_dim(head_dim: int, layers: int) -> dict[str, Any]:
    """Configs whose head_dim defaults to the released models' (128 or 256), not hidden/heads."""
    return {"head_dim": head_dim}


def _mistral(head_dim: int, layers: int) -> dict[str, Any]:
    """A sliding window in every layer, as Mistral 7B v0.1 (4096 there)."""
    return {"head_dim": head_dim, "sliding_window": SLIDING_WINDOW}


def _gemma2(head_dim: int, layers: int) -> dict[str, Any]:
    """Local (sliding) and global attention alternate; attention and final logits soft-capped
    (the config's defaults, 50 and 30); queries scaled by head_dim**-0.5 as in Gemma 2 2B/9B."""
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": types,
    }


def _gemma3(head_dim: int, layers: int) -> dict[str, Any]:
    """Five local layers to one global (fewer when the model is shallower, so that both kinds
    are in it), qk-norm instead of soft-capping, two rotary bases (the config's defaults)."""
    period = min(6, layers)
    types = [
        "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)
    ]
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": types,
    }


def _phi3(head_dim: int, layers: int) -> dict[str, Any]:
    """Fused qkv_proj and gate_up_proj (the modeling code's); rotary on 3/4 of each head as in
    Phi-4-mini; a sliding window in every layer as in Phi-3-mini (2047 there)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return {"rope_parameters": rope, "sliding_window": SLIDING_WINDOW}


def _granite(head_dim: int, layers: int) -> dict[str, Any]:
    """Granite 3's scaling of embeddings, residuals, attention scores and logits (the 2B
    model's values; its attention multiplier is 1/head_dim)."""
    return {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 1.0 / head_dim,
        "logits_scaling": 8.0,
    }


# Decoder-only families built from `hidden_size`, `num_attention_heads`, ...: transformers'
# config class, and what the family sets beyond those. Qwen2's q/k/v biases and the qk-norms of
# Qwen3, Gemma 3 and OLMo 2 (OLMo 2's over all heads, after the projections, with its norms
# after attention and MLP) are in the modeling code.
_DECODERS: dict[str, tuple[str, Callable[[int, int], dict[str, Any]]]] = {
    "llama": ("LlamaConfig", _defaults),
    "qwen2": ("Qwen2Config", _defaults),
    "mistral": ("MistralConfig", _mistral),
    "gemma": ("GemmaConfig", _head_dim),
    "qwen3": ("Qwen3Config", _head_dim),
    "gemma2": ("Gemma2Config", _gemma2),
    "gemma3": ("Gemma3TextConfig", _gemma3),
    "phi3": ("Phi3Config", _phi3),
    "olmo2": ("Olmo2Config", _defaults),
    "granite": ("GraniteConfig", _granite),
}
# Input and output embeddings tied, as in the family's small released models (Llama 2, Mistral
# 7B, Phi-3-mini, OLMo 2 and Pythia do not tie; Qwen2.5/Qwen3 up to 4B, Gemma 1-3, Granite 3
# 2B and GPT-2 do).
TIED_FAMILIES = frozenset({"qwen2", "gemma", "gpt2", "qwen3", "gemma2", "gemma3", "granite"})


# transformers' names of the sizes (Llama's, GPT-2's), taken as well as the short ones.
TRANSFORMERS_NAMES = {
    "num_hidden_layers": "num_layers",
    "n_layer": "num_layers",
    "num_attention_heads": "num_heads",
    "n_head": "num_heads",
    "max_position_embeddings": "max_positions",
    "n_positions": "max_positions",
    "n_embd": "hidden_size",
}


def tiny_model_config(
    arch: str,
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 1024,
    special_ids: dict[str, int] | None = None,
    tie_word_embeddings: bool | None = None,
    **transformers_names: int,
) -> Any:
    """A small transformers config of the given architecture family, built with transformers'
    own config class, that keeps what sets the family apart in training (`_DECODERS` and the
    functions it names). `tie_word_embeddings` None: the family's released models' choice.

    The sizes: `hidden_size`, `num_layers`, `num_heads` (key/value heads: half of them),
    `max_positions` (the context length); transformers' names for them work too
    (`num_hidden_layers`, `num_attention_heads`, `max_position_embeddings`, GPT-2's `n_layer`,
    `n_head`, `n_positions`, `n_embd`). The same keywords pass through `save_tiny_model`,
    `save_chat_model` and `build_demo_assets`."""
    import transformers

    sizes = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
             "max_positions": max_positions}  # fmt: skip
    for name, value in transformers_names.items():
        if name not in TRANSFORMERS_NAMES:
            known = sorted([*sizes, "special_ids", "tie_word_embeddings", *TRANSFORMERS_NAMES])
            raise TypeError(
                f"tiny_model_config() got an unexpected keyword argument {name!r}; the sizes "
                f"it takes: {', '.join(known)}"
            )
        sizes[TRANSFORMERS_NAMES[name]] = value
    hidden_size, num_layers = sizes["hidden_size"], sizes["num_layers"]
    num_heads, max_positions = sizes["num_heads"], sizes["max_positions"]
    ids = special_ids or {}
    head_dim = hidden_size // num_heads
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("pad"),
    }
    intermediate = 2 * hidden_size
    if arch in TINY_MOE_ARCHITECTURES:
        return _tiny_moe_config(arch, hidden_size, num_layers, num_heads, max_positions, common)
    tied = arch in TIED_FAMILIES if tie_word_embeddings is None else tie_word_embeddings
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_positions=max_positions,
            n_inner=intermediate,
            tie_word_embeddings=tied,
            **common,
        )
    if arch == "gpt_neox":  # rotary on a quarter of each head (rotary_pct 0.25), as Pythia
        return transformers.GPTNeoXConfig(
            hidden_size=hidden_size,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tied,
            **common,
        )
    if arch not in _DECODERS:
        raise ValueError(f"Unknown tiny architecture {arch!r}; choose from {TINY_ARCHITECTURES}.")
    cls_name, family = _DECODERS[arch]
    return getattr(transformers, cls_name)(
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        **family(head_dim, num_layers),
        **common,
    )


def _tiny_moe_config(
    arch: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    max_positions: int,
    common: dict[str, Any],
) -> Any:
    """4 experts of hidden_size x hidden_size, 2 routed per token; Qwen2-MoE adds its shared
    expert. Untied embeddings, as in the released models."""
    import transformers

    shared: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": max(1, num_heads // 2),
        "max_position_embeddings": max_positions,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        **common,
    }
    if arch == "mixtral":
        return transformers.MixtralConfig(
            intermediate_size=hidden_size, num_local_experts=4, **shared
        )
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            intermediate_size=hidden_size,
            num_local_experts=4,
            head_dim=hidden_size // num_heads,
            # gpt-oss's YaRN scaling (x32), from a context 32 times shorter than this one.
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": max(1, max_positions // 32),
            },
            **shared,
        )
    cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "olmoe": transformers.OlmoeConfig,
    }[arch]
    extra: dict[str, Any] = {
        "qwen3_moe": {"head_dim": hidden_size // num_heads},
        "qwen2_moe": {"shared_expert_intermediate_size": 2 * hidden_size},
        "olmoe": {},
    }[arch]
    if arch != "olmoe":
        extra["moe_intermediate_size"] = hidden_size
    return cls(intermediate_size=hidden_size, num_experts=4, **extra, **shared)


def save_tiny_model(
    folder: str | Path, tokenizer: Any, arch: str = "llama", seed: int = 0, **config_kwargs: Any
) -> Path:
    """Initialise a tiny model for `tokenizer` and save it (safetensors) with the tokenizer.
    `config_kwargs`: the sizes `tiny_model_config` takes (`num_layers=4` or
    `num_hidden_layers=4`, `hidden_size`, `num_heads`, `max_positions`, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    special_ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    config = tiny_model_config(arch, len(tokenizer), special_ids=special_ids, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


# --- everything for the demo ---------------------------------------------------------------


def iter_rendered(games: list[dict[str, Any]], template: str = DEFAULT_TEMPLATE) -> Iterator[str]:
    for game in games:
        yield render_row(game, template)


def build_demo_assets(
    root: str | Path,
    *,
    num_games: int = 3000,
    num_shards: int = 2,
    arch: str = "llama",
    vocab_size: int = 512,
    seed: int = 0,
    games: list[dict[str, Any]] | None = None,
    **model_kwargs: Any,
) -> dict[str, Path]:
    """Create `root/data` (parquet shards) and `root/model` (tiny model + tokenizer): the games
    given (`games`, e.g. the engine's self-play games), else `num_games` random ones.

    Returns {"data": folder, "model": folder}.
    """
    root = Path(root)
    if games is None:
        games = random_games(num_games, seed=seed)
    data_dir = root / "data"
    write_chess_shards(games, data_dir, num_shards=num_shards)
    tokenizer = train_chess_tokenizer(list(iter_rendered(games)), vocab_size=vocab_size)
    model_dir = save_tiny_model(root / "model", tokenizer, arch=arch, seed=seed, **model_kwargs)
    return {"data": data_dir, "model": model_dir}


# --- chat: tokenizers with chat templates, conversations -----------------------------------

# Three template families users meet, written as the models ship them (shortened):
# ChatML (Qwen 2.5: no generation markers, the end-of-turn token is the tokenizer's EOS),
# Llama 3 (BOS written by the template itself, headers around each role) and ChatML with
# `{% generation %}` markers (as TRL's training templates add them).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Like Qwen3's: earlier answers lose their <think>...</think> part once the conversation goes
# on, so a conversation's beginning renders differently alone and in the whole.
THINK_DROPPING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1] %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CHAT_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# style -> (chat template, special tokens); "plain" has no chat template.
CHAT_STYLES: dict[str, tuple[str | None, dict[str, str]]] = {
    "chatml": (CHATML_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": (
        LLAMA3_TEMPLATE,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|endoftext|>"},
    ),
    "chatml_generation": (
        CHATML_GENERATION_TEMPLATE,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "think_dropping": (
        THINK_DROPPING_TEMPLATE,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "plain": (None, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
}

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "gi", "the", "and")


def random_words(rng: random.Random, n: int) -> str:
    """n pseudo-words of 1-3 syllables: text no model can predict beyond its letters."""
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)
    )


def random_conversations(
    n: int,
    seed: int = 0,
    *,
    turns: tuple[int, int] = (1, 1),
    words: tuple[int, int] = (3, 12),
    answer: str | None = None,
    system: str | None = None,
) -> list[list[dict[str, str]]]:
    """n conversations of user/assistant turns (a number of turns drawn from `turns`).
    Prompts are random words; answers too, or always `answer` when given."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        messages = [{"role": "system", "content": system}] if system else []
        for _ in range(rng.randint(*turns)):
            messages.append({"role": "user", "content": random_words(rng, rng.randint(*words))})
            reply = answer if answer is not None else random_words(rng, rng.randint(*words))
            messages.append({"role": "assistant", "content": reply})
        conversations.append(messages)
    return conversations


def preference_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n preference rows (prompt, chosen, rejected) with a rule to learn: the chosen answer says
    "ka" as many times as the prompt has words, the rejected one as many random words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.randint(1, 4)
        rejected = random_words(rng, words)
        rows.append(
            {
                "prompt": random_words(rng, words) + "\n",
                "chosen": " ".join(["ka"] * words),
                "rejected": rejected if rejected.split() != ["ka"] * words else "lo",
            }
        )
    return rows


def train_chat_tokenizer(vocab_size: int = 600, seed: int = 0) -> Any:
    """A byte-level BPE (any text encodes, as with GPT-2, Llama 3 or Qwen) trained on random
    conversations, with the special tokens of the chat templates above. Returns a
    `tokenizers.Tokenizer`; `chat_tokenizer` wraps it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [
        "\n".join(f"{m['role']}\n{m['content']}" for m in conversation)
        for conversation in random_conversations(2000, seed, turns=(1, 3), system="be brief")
    ]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def chat_tokenizer(style: str = "chatml", *, base: Any = None) -> Any:
    """A transformers tokenizer of a `CHAT_STYLES` family: its chat template and special
    tokens. A BOS the template writes is also what the tokenizer adds by itself (as Llama 3's
    does), so tokenising a rendered conversation with special tokens would double it."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    template, special = CHAT_STYLES[style]
    tokenizer = copy.deepcopy(base) if base is not None else train_chat_tokenizer()
    bos = special.get("bos_token")
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))],
        )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    if template is not None:
        wrapped.chat_template = template
    return wrapped


def save_chat_model(
    folder: str | Path, style: str = "chatml", *, base: Any = None, **model_kwargs: Any
) -> Path:
    """A tiny Llama with a chat tokenizer of `style` (see `chat_tokenizer`)."""
    return save_tiny_model(folder, chat_tokenizer(style, base=base), **model_kwargs)
