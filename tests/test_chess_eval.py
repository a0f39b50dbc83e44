"""The chess evaluation without training: the referee's rules, scripted players through the
real decoding loop and tokenizer, sharding over ranks, the standalone CLI and its errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import chess
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_utils.chess_eval import ChessEvaluator
from fsdp_utils.chess_eval.cli import main as chess_eval_main
from fsdp_utils.chess_eval.games import OPENING_PLIES, make_prefixes
from fsdp_utils.chess_eval.referee import board_after, judge
from fsdp_utils.cli import main as finetune_main
from fsdp_utils.config.train_config import TrainConfig
from fsdp_utils.data.prepare import held_out_games
from tests.chess_players import ScriptedPlayer, fixed_writer, legal_writer

PLIES = 6
# The integer counts of a result: they add up over ranks.
COUNTS = ("continuations", "moves_judged", "illegal_moves", "games_ended", "next_move_total")


@pytest.fixture(scope="module")
def config(tiny_assets, tmp_path_factory) -> TrainConfig:
    return TrainConfig(
        model=str(tiny_assets["model"]), dataset=str(tiny_assets["data"]), dataset_include="",
        data_cache_dir=str(tmp_path_factory.mktemp("chess_eval_cache")), max_seq_length=512,
        eval_examples=20, chess_eval_games=6, chess_eval_plies=PLIES,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["model"])


@pytest.fixture(scope="module")
def games(config):
    return held_out_games(config, limit=config.chess_eval_games)


def _evaluator(games, tokenizer, config, **kw) -> ChessEvaluator:
    return ChessEvaluator(
        games, tokenizer, template=config.template, plies=PLIES, max_seq_length=512,
        seed=config.seed, batch_size=4, **kw,
    )  # fmt: skip


# --- the referee -----------------------------------------------------------------------


def test_referee_counts_legal_moves_and_waits_for_complete_words():
    start = chess.Board()
    assert judge(start, " e2e4 e7e5 ", plies=5, finished=False) is None  # more may come
    assert judge(start, " e2e4 e7", plies=5, finished=False) is None  # "e7" may go on
    v = judge(start, " e2e4 e7e5 g1f3", plies=5, finished=True)
    assert (v.legal_plies, v.failure, v.ended) == (3, "no_move", False)  # ended mid-game
    assert v.moves_judged == 4
    v = judge(start, " e2e4 e7e5 x", plies=2, finished=False)  # K reached: the rest is not read
    assert (v.legal_plies, v.failure) == (2, None)
    v = judge(start, " a2a4 b7b5 a4b5 a7a5 b5a6 c8b7 a6b7 d7d6 b7a8q", plies=9, finished=True)
    assert (v.legal_plies, v.failure) == (9, None)  # capture en passant, promotion


@pytest.mark.parametrize(
    "text,failure",
    [
        (" Nf3", "unparseable"),  # SAN
        (" E2E4", "unparseable"),
        (" 0000", "unparseable"),  # the null move
        (" e2e4q", "illegal"),  # UCI, but no promotion there
        (" e1g1", "illegal"),  # castling through pieces
        (" e2e5", "illegal"),
        (" e9e4", "unparseable"),
        (" a1a1", "unparseable"),  # python-chess writes no move to its own square
        ("e2e4", "unparseable"),  # glued to the prompt's last word
        (" [Result 1-0]", "unparseable"),
        (" e2e4</s>", "unparseable"),  # a special token inside a word
        ("", "no_move"),
    ],
)
def test_referee_failures(text, failure):
    v = judge(chess.Board(), text, plies=3, finished=True)
    assert v.failure == failure and v.legal_plies == 0 and v.moves_judged == 1


def test_referee_game_ends_mate_after_end_and_draw_claims():
    fools = board_after(["f2f3", "e7e5", "g2g4"])
    v = judge(fools, " d8h4", plies=5, finished=True)
    assert (v.legal_plies, v.failure, v.ended, v.result) == (1, None, True, "0-1")
    assert judge(fools, " d8h4", plies=5, finished=False) is None  # EOS or another word?
    v = judge(fools, " d8h4 e", plies=5, finished=False)
    assert (v.legal_plies, v.failure, v.ended) == (1, "after_end", True)
    repeated = board_after(["g1f3", "g8f6", "f3g1", "f6g8"] * 2)  # threefold: claimable
    v = judge(repeated, "", plies=5, finished=True)
    assert (v.failure, v.ended, v.result) == (None, True, "1/2-1/2")
    with pytest.raises(ValueError, match="at least 1"):
        judge(chess.Board(), " e2e4", plies=0, finished=True)


def test_prefixes_cover_opening_middlegame_and_ending(games, config):
    prefixes = make_prefixes(games, config.template, plies=PLIES, seed=config.seed)
    assert len(prefixes) == 3 * len(games)
    for p in prefixes:
        game = games[p.game]
        assert list(p.moves) == list(game["Moves"][: len(p.moves)])
        assert p.prompt.startswith(f"[Result {game['Result']}]") and p.prompt == p.prompt.rstrip()
        assert p.header_result == game["Result"]
        if p.phase == "opening":  # one of the first plies, seeded per game
            assert len(p.moves) <= OPENING_PLIES
        if p.phase == "ending":
            assert len(p.moves) == len(game["Moves"]) - PLIES // 2
    openings = [p.moves for p in prefixes if p.phase == "opening"]
    assert len(set(openings)) > len(openings) // 2  # not every game's start position
    no_header = make_prefixes(games, "{moves}", plies=PLIES, seed=config.seed)
    assert len(no_header) == len(prefixes) and all(p.header_result is None for p in no_header)


# --- scripted players through the real decoding loop -------------------------------------


def test_a_player_that_always_plays_legal_moves_scores_100_percent(games, tokenizer, config):
    player = ScriptedPlayer(tokenizer, legal_writer(PLIES))
    m = _evaluator(games, tokenizer, config).run(player)
    assert m["legal_move_rate"] == 1.0 and m["full_length_share"] == 1.0
    assert m["illegal_moves"] == 0 and m["continuations"] == 3 * len(games)
    for phase in ("opening", "middlegame", "ending"):
        assert m[f"legal_move_rate_{phase}"] == 1.0
    assert m["mean_legal_plies"] > PLIES / 2  # ending prefixes may finish the game first
    # The oracle predicts every next token, so every move is the top-1 move.
    assert m["next_move_accuracy"] == 1.0
    assert m["next_move_total"] == sum(len(g["Moves"]) for g in games)


@pytest.mark.parametrize(
    "garbage,failure",
    [
        (fixed_writer(" Nf3 Nc6 Bb5"), "unparseable"),
        (fixed_writer(" a1c2q a1c2q"), "illegal"),  # well-formed, never legal
        (fixed_writer("", eos=True), "no_move"),
        (fixed_writer("q e2e4"), "unparseable"),  # glued to the prompt
        (fixed_writer(" " + "e2e4" * 40), "unparseable"),  # no space before the budget ends
        (fixed_writer(" ♞💥 ##"), "unparseable"),  # unknown to the tokenizer
    ],
)
def test_garbage_scores_zero_without_crashing(games, tokenizer, config, garbage, failure):
    m = _evaluator(games, tokenizer, config).run(ScriptedPlayer(tokenizer, garbage))
    assert m["legal_move_rate"] == 0.0 and m["mean_legal_plies"] == 0.0
    # An early EOS is a legal end where a draw can be claimed; everything else fails.
    assert m[f"illegal_{failure}"] == m["illegal_moves"] > 0
    assert m["illegal_moves"] >= m["continuations"] - m["games_ended"]


def test_a_real_model_that_emits_garbage_scores_zero(tiny_assets, games, tokenizer, config):
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    junk = tokenizer.convert_tokens_to_ids("[Result</w>")
    head = torch.nn.Linear(model.config.hidden_size, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[junk] = 10.0
    model.lm_head = head
    m = _evaluator(games, tokenizer, config).run(model.eval())
    assert m["legal_move_rate"] == 0.0 and m["illegal_unparseable"] == m["continuations"]
    assert m["next_move_accuracy"] == 0.0
    assert "[Result" in m["examples"][0].continuation


def test_decoding_passes_the_kv_cache_as_transformers_names_it(tiny_assets, tokenizer, caplog):
    """The cached decoding gives the tokens a full forward per token gives, and passes the
    cache by its current name: transformers 5.x warns (once, at the end of `make demo` and the
    chess evaluation) of `past_key_values`' removal when it is passed or read."""
    import logging

    from transformers.utils import logging as hf_logging

    from fsdp_utils.parallel.generate import continue_prompts

    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"]).eval()
    prompts = [tokenizer("1.e4 e5 2.Nf3")["input_ids"], tokenizer("1.d4")["input_ids"]]
    hf_logging.warning_once.cache_clear()  # another test may have had it printed already
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            out = continue_prompts(
                model, prompts, pad_token_id=tokenizer.pad_token_id or 0, eos_token_id=-1,
                max_new_tokens=6, is_done=lambda b, t: False, device=torch.device("cpu"),
            )  # fmt: skip
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "past_key_values" in r.getMessage()]
    for prompt, got in zip(prompts, out, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):  # no cache: the whole sequence each time
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got.tokens == ids[len(prompt) :]


def test_a_masked_move_is_the_models_most_likely_legal_move(tiny_assets, tokenizer):
    """`continuation_logprobs`, as masked games use it: each legal move's log-probability (the
    sum over its tokens, several for some moves with this tokenizer) equals a plain forward's,
    on prompts of different lengths in one left-padded batch, so the masked move is the most
    likely legal one by the model's own probabilities."""
    from fsdp_utils.parallel.generate import continuation_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"]).eval()
    texts = [
        "[Result 1-0] [Termination CHECKMATE]",
        "[Result 0-1] [Termination CHECKMATE] e2e4 e7e5 g1f3",
    ]
    boards = [chess.Board(), board_after(["e2e4", "e7e5", "g1f3"])]
    prompts, candidates = [], []
    for text, board in zip(texts, boards, strict=True):
        ids = tokenizer(text)["input_ids"]
        prompts.append(ids)
        candidates.append(
            [tokenizer(f"{text} {m.uci()}")["input_ids"][len(ids) :] for m in board.legal_moves]
        )
    assert any(len(c) > 1 for cands in candidates for c in cands)  # moves of several tokens
    got = continuation_logprobs(
        model, prompts, candidates, pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"),
        batch_size=3,
    )  # fmt: skip
    for ids, cands, scores in zip(prompts, candidates, got, strict=True):
        for cand, score in zip(cands, scores, strict=True):
            with torch.no_grad():
                logps = torch.log_softmax(model(torch.tensor([ids + cand])).logits[0].double(), -1)
            want = sum(float(logps[len(ids) - 1 + j, t]) for j, t in enumerate(cand))
            assert score == pytest.approx(want, abs=1e-4)
        assert 0 < sum(math.exp(x) for x in scores) <= 1  # the probability on the legal moves


def test_the_headline_figure_counts_an_illegal_move_as_the_worst():
    """engine_metrics' arithmetic: every move (an illegal one at 1000 cp and accuracy 0) beside
    the legal moves alone, each with its standard error, and the counts they rest on."""
    from fsdp_utils.chess_eval.figures import engine_metrics

    def legal(position, loss, accuracy, phase="opening"):
        return {"position": position, "ply": 0, "phase": phase, "legal": True, "cp_loss": loss,
                "accuracy": accuracy, "is_best": loss == 0, "judgement": None}  # fmt: skip

    records = [
        legal(0, 0, 100.0), legal(1, 100, 80.0, "middlegame"), legal(2, 200, 60.0, "ending"),
        {"position": 3, "ply": 0, "phase": "ending", "legal": False, "failure": "illegal"},
    ]  # fmt: skip
    m = engine_metrics(records)
    assert (m["engine_positions"], m["engine_moves"], m["engine_illegal"]) == (4, 3, 1)
    assert m["engine_all_centipawn_loss"] == (0 + 100 + 200 + 1000) / 4
    assert m["engine_all_accuracy"] == (100 + 80 + 60 + 0) / 4
    every = [0, 100, 200, 1000]
    sd = math.sqrt(sum((x - 325) ** 2 for x in every) / 3)
    assert m["engine_all_centipawn_loss_se"] == pytest.approx(sd / 2)
    assert m["engine_centipawn_loss"] == 100 and m["engine_accuracy"] == 80
    assert m["engine_centipawn_loss_se"] == pytest.approx(100 / math.sqrt(3))
    assert m["engine_accuracy_se"] == pytest.approx(20 / math.sqrt(3))
    assert m["engine_best_move_rate"] == pytest.approx(1 / 3)
    assert (m["engine_moves_ending"], m["engine_illegal_ending"]) == (1, 1)
    one = engine_metrics(records[:1])
    assert one["engine_centipawn_loss_se"] is None  # one move has no standard error


def test_ranks_share_the_work_and_add_up(games, tokenizer, config):
    """Without a process group each rank keeps its own counts: rank 0 + rank 1 = one rank,
    and both ranks run the same number of forward passes."""
    whole = _evaluator(games, tokenizer, config).run(ScriptedPlayer(tokenizer, legal_writer(PLIES)))
    parts, calls = [], []
    for rank in (0, 1):
        player = ScriptedPlayer(tokenizer, legal_writer(PLIES))
        ev = _evaluator(games, tokenizer, config, rank=rank, world_size=2)
        parts.append(ev.run(player))
        calls.append(sum(1 for _ in ev._batches(ev.prefixes)))
    for key in COUNTS:
        assert parts[0][key] + parts[1][key] == whole[key], key
    assert calls[0] == calls[1]


# --- the standalone command and its errors ----------------------------------------------


def _cli_args(config: TrainConfig, model: Path | str, *extra: str) -> list[str]:
    return [
        str(model), "--dataset", config.dataset, "--dataset_include", "",
        "--data_cache_dir", str(config.data_cache_dir), "--max_seq_length", "512",
        "--eval_examples", "20", "--games", "6", "--plies", str(PLIES), "--json", *extra,
    ]  # fmt: skip


def test_standalone_json_and_a_lora_adapter(tiny_assets, config, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    assert chess_eval_main(_cli_args(config, tiny_assets["model"])) == 0
    base = json.loads(capsys.readouterr().out)
    assert base["continuations"] == 18 and 0.0 <= base["legal_move_rate"] <= 1.0
    assert base["examples"][0]["phase"] == "opening"
    # A fresh LoRA adapter is the identity (B = 0): the same numbers through peft.
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.peft_config["default"].base_model_name_or_path = str(tiny_assets["model"])
    lora.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert chess_eval_main(_cli_args(config, tmp_path / "adapter")) == 0
    adapted = json.loads(capsys.readouterr().out)
    for key in (*COUNTS, "legal_move_rate", "next_move_accuracy"):
        assert adapted[key] == base[key], key


def test_bad_input_is_one_paragraph_and_exit_2(tiny_assets, config, tmp_path, capsys):
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_assets["model"], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    assert chess_eval_main(_cli_args(config, no_tokenizer)) == 2
    assert "has no tokenizer" in capsys.readouterr().err

    text_data = tmp_path / "text.jsonl"
    text_data.write_text("".join(json.dumps({"text": f"hello {i}"}) + "\n" for i in range(30)))
    args = _cli_args(config, tiny_assets["model"])
    args[args.index("--dataset") + 1] = str(text_data)
    assert chess_eval_main(args) == 2
    err = capsys.readouterr().err
    assert "needs chess games" in err and "Traceback" not in err

    for flag in ("--plies", "--chess_eval_plies"):
        args = _cli_args(config, tiny_assets["model"])
        args[args.index("--plies")] = flag
        args[args.index(flag) + 1] = "0"
        assert chess_eval_main(args) == 2
        assert "--chess_eval_plies" in capsys.readouterr().err
    # The trainer checks K before anything starts.
    assert finetune_main(["--chess_eval_plies", "-1", "--model", str(tiny_assets["model"])]) == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_a_grpo_runs_model_is_judged_on_the_games_of_the_run_it_came_from(
    tiny_assets, config, tmp_path, capsys
):
    """A GRPO chess run trained on prompts: evaluating it says where its games are (the run its
    model came from, as --config), and that run's own config.json is taken as --config."""
    from tests.grpo_helpers import write_prompts

    def run_folder(name: str, options: dict) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "final").symlink_to(tiny_assets["model"], target_is_directory=True)
        record = {"config": options, "resolved": {"world_size": 2}, "versions": {"torch": "x"}}
        (folder / "config.json").write_text(json.dumps(record))
        return folder

    same = {"dataset_include": "", "data_cache_dir": config.data_cache_dir, "eval_examples": 20,
            "max_seq_length": 512, "num_epochs": 1}  # fmt: skip
    sft = run_folder("sft", {"model": str(tiny_assets["model"]), "dataset": config.dataset, **same})
    prompts = write_prompts(tiny_assets["data"], tmp_path / "prompts.jsonl")
    grpo = run_folder("grpo", {"model": str(sft / "final"), "dataset": str(prompts), **same})
    assert chess_eval_main([str(grpo), "--preflight"]) == 2
    err = capsys.readouterr().err
    assert "holds prompts" in err and "Traceback" not in err
    assert f"python -m fsdp_utils.chess_eval {grpo} --config {sft / 'config.json'}" in err
    assert chess_eval_main([str(grpo), "--config", str(sft / "config.json"), "--preflight"]) == 0
    assert "preflight OK" in capsys.readouterr().out
