"""GRPO's pieces without a training run's torchrun: the reward functions (loading, TRL's call,
the checks), the built-in rewards (Stockfish for the engine's), the prompt set (text and chat
prompts as TRL encodes them), the rollout buffer, the planner's rollout phase, and every bad
input ending in one paragraph with exit 2 (chess_finetune.py's main, in this process)."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import chess
import pytest
import torch

from fsdp_utils.chess_eval import rewards as chess_rewards
from fsdp_utils.cli import main
from fsdp_utils.methods.grpo import builtin_rewards
from fsdp_utils.methods.grpo.rewards import (
    RewardError,
    RewardLog,
    TrainerState,
    load_reward_function,
    score,
)
from tests.grpo_helpers import grpo_args, write_prompts, write_rewards

STATE = TrainerState(global_step=0, max_steps=1, epoch=0.0)


@pytest.fixture(scope="module")
def setup(tiny_assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo_units")
    return {
        "root": root,
        "model": tiny_assets["model"],
        "games": tiny_assets["data"],
        "prompts": write_prompts(tiny_assets["data"], root / "prompts.jsonl"),
        "rewards": write_rewards(root / "rewards"),
        "cache": root / "cache",
    }


def _score(function: Any, completions: list[Any], **columns: Any) -> torch.Tensor:
    reward = load_reward_function("length")
    reward.function, reward.name = function, getattr(function, "__name__", "f")
    return score(
        [reward], prompts=["p"] * len(completions), completions=completions,
        completion_ids=[[1]] * len(completions), columns=columns, state=STATE, log=RewardLog(),
    )[:, 0]  # fmt: skip


# --- reward functions ------------------------------------------------------------------------


def test_a_reward_gets_trls_keywords_and_may_skip_or_be_async():
    seen: dict[str, Any] = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(answer=answer, state=trainer_state, kwargs=sorted(kwargs))
        kwargs["log_metric"]("spied", 2.0)
        return [None, 0.5]

    assert _score(spy, ["a", "b"], answer=["1", "2"]).tolist()[1] == 0.5
    assert math.isnan(_score(spy, ["a", "b"], answer=["1", "2"])[0])  # None: skipped
    assert seen["answer"] == ["1", "2"] and seen["state"].global_step == 0
    assert seen["kwargs"] == ["log_extra", "log_metric"]

    async def later(completions, **kwargs):
        return [1.0] * len(completions)

    assert _score(later, ["a"]).tolist() == [1.0]


@pytest.mark.parametrize(
    "returns, message",
    [
        (lambda completions, **k: [1.0], r"returned 1 values for 2 completions"),
        (lambda completions, **k: [1.0, math.nan], r"returned nan for sample 1: prompt 'p'"),
        (lambda completions, **k: 1 / 0, r"raised ZeroDivisionError: division by zero \("),
        (lambda completions, **k: 3.0, r"returned float for 2 completions"),
    ],
)
def test_a_reward_that_fails_names_itself_and_the_sample(returns, message):
    with pytest.raises(RewardError, match=message):
        _score(returns, ["x", "y"])


def test_reward_functions_load_from_a_file_or_by_built_in_name(setup):
    loaded = load_reward_function(f"{setup['rewards']}:constant")
    assert loaded.name == "constant" and loaded.function(completions=["a"]) == [1.0]
    assert load_reward_function("exact_answer").function is builtin_rewards.exact_answer
    with pytest.raises(ValueError, match=r"neither FILE\.py:FUNCTION nor a built-in reward"):
        load_reward_function("exact_answr")


# --- the built-in rewards --------------------------------------------------------------------


def test_exact_answer_reads_gsm8k_and_boxed_answers():
    completions = [
        "So 3 + 4 = 7.\n#### 7",
        "The answer is \\boxed{7.0}.",
        "I think it is 8",
        [{"role": "assistant", "content": "It costs $1,000.\n#### 1000"}],
        "anything",
    ]
    answers = ["Add them.\n#### 7", "\\boxed{7}", "#### 7", "#### 1,000", None]
    rewards = builtin_rewards.exact_answer(completions, answer=answers)
    assert rewards == [1.0, 1.0, 0.0, 1.0, None]
    assert builtin_rewards.final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="needs a column `answer`"):
        builtin_rewards.exact_answer(["1"])


def test_length_is_trls_example():
    assert builtin_rewards.length(["x" * 20, "x" * 5, "x" * 30]) == [0, -15, -10]


def test_chess_rewards_judge_the_first_move_in_the_rows_position():
    moves = [["e2e4"], ["e2e4"], ["e2e4"], ["e2e4"]]
    completions = [" e7e5 g1f3", " e7e6", "e7e5", " e2e4"]  # legal, legal, glued, illegal
    assert builtin_rewards.chess_format(completions, moves=moves) == [1.0, 1.0, 0.0, 1.0]
    assert builtin_rewards.chess_legal(completions, moves=moves) == [1.0, 1.0, 0.0, 0.0]
    fen = chess.Board().fen()
    assert builtin_rewards.chess_legal([" g1f3", " g1g3"], fen=[fen, fen]) == [1.0, 0.0]
    # A chat completion is a reply of its own: its move needs no space before it.
    chat = [[{"role": "assistant", "content": "e7e5"}], [{"role": "assistant", "content": "x"}]]
    assert builtin_rewards.chess_legal(chat, moves=moves[:2]) == [1.0, 0.0]
    assert builtin_rewards.chess_format(chat, moves=moves[:2]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="a column `fen`"):
        builtin_rewards.chess_legal([" e2e4"])


def test_the_engine_reward_is_the_judges_accuracy_and_nothing_for_an_illegal_move(tmp_path):
    from fsdp_utils.chess_eval.rewards import EngineReward

    # After 1. e4 e5 2. Qh5 Nc6 3. Bc4 Nf6??: Qxf7 is mate, a3 lets it go.
    moves = [["e2e4", "e7e5", "d1h5", "b8c6", "f1c4", "g8f6"]] * 3
    from fsdp_utils.chess_eval.judge import find_engine
    from fsdp_utils.chess_eval.rewards import use_engine_path

    given = tmp_path / "my-stockfish"  # --chess_engine's, for an EngineReward without its own
    given.symlink_to(find_engine())
    use_engine_path(str(given))
    try:
        with contextlib_closing(EngineReward(depth=6)) as engine:
            rewards = engine([" h5f7", " a2a3", " h5h9"], moves=moves)
            assert engine.judge.path == str(given)
    finally:
        use_engine_path(None)
    assert rewards[0] == 1.0  # the best move loses nothing
    assert 0.0 <= rewards[1] < 0.5  # throws the win away
    assert rewards[2] == 0.0  # not a move


def test_the_centipawn_reward_is_dense_on_known_positions():
    """chess_centipawn: 1 - cp_loss / 1000 for a legal move (the best 1.0, a thrown-away mate
    0.0, a quiet slip in between, as the judge scores it), -1.0 for an illegal or unparseable
    one: below every legal move."""
    from fsdp_utils.chess_eval.judge import EngineJudge
    from fsdp_utils.chess_eval.rewards import EngineReward

    mate = ["e2e4", "e7e5", "d1h5", "b8c6", "f1c4", "g8f6"]  # Qxf7 is mate, a3 lets it go
    rows = {"moves": [mate, mate, mate, mate, [], []]}
    texts = [" h5f7", " a2a3", " h5h9", " Qxf7", " e2e4", " g1h3"]
    with contextlib_closing(EngineReward(depth=6, kind="centipawn")) as engine:
        rewards = engine(texts, **rows)
    assert rewards[:4] == [1.0, 0.0, -1.0, -1.0]
    with EngineJudge(depth=6) as judge:
        start = chess.Board()
        for text, reward in zip(texts[4:], rewards[4:], strict=True):
            loss = judge.judge_move(start, chess.Move.from_uci(text.strip())).cp_loss
            assert reward == 1.0 - loss / 1000
    assert 0.0 < rewards[5] < 1.0 and rewards[5] < rewards[4]  # Nh3 is worse than e4
    builtin = builtin_rewards.chess_centipawn([" h5f7", " h5h9"], moves=[mate, mate])
    assert builtin == [1.0, -1.0]
    with contextlib_closing(EngineReward(depth=6, kind="centipawn")) as engine:  # a reward file's
        assert engine([[{"role": "assistant", "content": "h5f7"}]], moves=[mate]) == [1.0]
    chess_rewards.close_shared()


def test_the_engine_reward_goes_on_through_a_killed_and_a_stopped_engine():
    """A real Stockfish killed (SIGKILL) and another frozen (SIGSTOP) in the middle of a
    reward: each is restarted and the position judged again, the reward is what a fresh
    engine gives, and each restart is counted and said once."""
    from fsdp_utils.chess_eval.rewards import EngineReward, take_restart_notes

    take_restart_notes()  # the notes of earlier tests' engines
    rows = [(["e2e4"], " e7e5"), (["d2d4"], " g8f6"), (["c2c4"], " e7e5")]
    with contextlib_closing(EngineReward(depth=6, kind="centipawn")) as fresh:
        want = [fresh([text], moves=[moves])[0] for moves, text in rows]
    with contextlib_closing(EngineReward(depth=6, kind="centipawn", timeout_s=1.0)) as engine:
        got = [engine([rows[0][1]], moves=[rows[0][0]])[0]]
        os.kill(engine.judge.engine.transport.get_pid(), signal.SIGKILL)
        got.append(engine([rows[1][1]], moves=[rows[1][0]])[0])
        stopped = engine.judge.engine.transport.get_pid()
        os.kill(stopped, signal.SIGSTOP)  # hangs: only the judge's timer ends it
        got.append(engine([rows[2][1]], moves=[rows[2][0]])[0])
        assert engine.restarts == 2
    assert got == want
    notes = take_restart_notes()
    assert len(notes) == 2 and take_restart_notes() == []
    assert "the process exited" in notes[0] and "no answer within 1 s" in notes[1]
    assert "restarted" in notes[0] and "Stockfish" in notes[0]


class contextlib_closing:  # a context manager named as contextlib's
    def __init__(self, thing: Any) -> None:
        self.thing = thing

    def __enter__(self) -> Any:
        return self.thing

    def __exit__(self, *exc: object) -> None:
        self.thing.close()


# --- prompts -----------------------------------------------------------------------------------


def test_prompts_are_encoded_as_trl_encodes_them(tmp_path):
    from transformers import AutoTokenizer

    from fsdp_utils.data.chat import chat_template
    from fsdp_utils.data.prompts import PromptEncoder, end_of_turn_id
    from fsdp_utils.synthetic import save_chat_model

    model = save_chat_model(tmp_path / "chat", "chatml")
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = chat_template(tokenizer, template_file=None, model=str(model))
    encode = PromptEncoder(tokenizer, template)
    messages = [{"role": "user", "content": "How many legs has a spider?"}]
    # TRL's call (GRPOTrainer._tokenize_prompts)
    expected = tokenizer.apply_chat_template(
        [messages], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    assert encode(messages, 0) == list(expected)
    assert encode("Plain text", 1) == tokenizer("Plain text")["input_ids"]
    # ChatML's end of turn is this tokenizer's EOS; on a base model's (EOS <|endoftext|>) it
    # is a stop token of its own
    assert end_of_turn_id(tokenizer, template) is None
    base = AutoTokenizer.from_pretrained(save_chat_model(tmp_path / "base", "plain"))
    assert end_of_turn_id(base, template) == base.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="Row 2 has no prompt"):
        encode("", 2)
    no_template = PromptEncoder(tokenizer, None)
    with pytest.raises(ValueError, match="--chat_template FILE"):
        no_template(messages, 3)


def test_the_rollout_buffer_keeps_every_prompt_through_a_checkpoint():
    from fsdp_utils.methods.grpo.rollouts import PromptRollout, RolloutBuffer

    buffer = RolloutBuffer(3, {7: PromptRollout([[1, 2], [3]], [True, False], [[1.0], [math.nan]])})
    buffer.prompts[7].old_logps = [[-0.1, -0.2], [-0.3]]
    again = RolloutBuffer.from_state(torch.load(_saved(buffer.state()), weights_only=False))
    assert again.batch == 3 and again.prompts[7].completions == [[1, 2], [3]]
    assert (
        again.prompts[7].old_logps == [[-0.1, -0.2], [-0.3]] and again.prompts[7].ref_logps is None
    )


def _saved(state: dict[str, Any]) -> Any:
    import io

    out = io.BytesIO()
    torch.save(state, out)
    out.seek(0)
    return out


# --- the planner ---------------------------------------------------------------------------


def test_the_plan_has_both_phases_and_the_largest_batch_that_fits_them(setup, capsys):
    args = grpo_args(
        setup["model"], setup["prompts"], setup["root"] / "plan", setup["cache"],
        reward_funcs=f"{setup['rewards']}:constant", num_generations=8,
        max_completion_length=16, total_batch_size=8, batch_size_per_device=2,
    )  # fmt: skip
    code = main(["--plan", *args, "--gpu_memory", "3GiB", "--gpus_per_node", "2", "--no_fixes"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "rollout phase" in out and "KV cache" in out and "gathered" in out
    assert "phase dominates" in out
    largest = next(line for line in out.splitlines() if "largest batch" in line)
    assert "prompt(s) x 8 =" in largest


def test_the_rollout_phase_counts_the_cache_and_the_gathered_parameters(setup):
    from transformers import AutoConfig

    from fsdp_utils.config.batch import plan_batch
    from fsdp_utils.config.parse import parse_config
    from fsdp_utils.plan.rollout import plan_rollout
    from fsdp_utils.plan.tracking import StepMemory

    flags = grpo_args(
        setup["model"], setup["prompts"], Path("x"), Path("y"), reward_funcs="length",
        precision="bf16-mixed", num_generations=8, total_batch_size=16, batch_size_per_device=2,
    )  # fmt: skip
    config, _ = parse_config(flags)
    hf = AutoConfig.from_pretrained(setup["model"])
    state = {"Sharded Param": 100, "OptState": 200, "Sharded Grad": 50}
    update = StepMemory(peak={}, peak_before_optimizer={}, before_optimizer=state)
    plan = plan_rollout(hf, config, plan_batch(config, 1), 1000, update)
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rows = 2 * 8  # prompts per micro-batch x G
    assert plan.rows == rows
    assert plan.kv_cache == hf.num_hidden_layers * 2 * kv_heads * head_dim * 2 * rows * 64
    assert plan.resident == 300 and plan.gathered == 1000  # the gradients are gone
    assert plan.total == 1300 + plan.kv_cache + plan.prefill + plan.logits


# --- bad input: one paragraph, exit 2 ------------------------------------------------------------


def _fails(capsys: Any, argv: list[str], *expected: str) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 2, text
    assert "Traceback" not in text, text
    for part in expected:
        assert part in text, text
    return text


def test_bad_input_ends_in_one_paragraph(setup, capsys, tmp_path):
    def args(**more: Any) -> list[str]:
        return grpo_args(
            setup["model"], setup["prompts"], tmp_path / "run", setup["cache"],
            max_training_steps=1, **{"reward_funcs": f"{setup['rewards']}:constant", **more},
        )  # fmt: skip

    _fails(capsys, args(reward_funcs="missing.py:f"), "missing.py is not a file")
    _fails(capsys, args(reward_funcs=f"{setup['rewards']}:nope"), "has no function 'nope'",
           "constant")  # fmt: skip
    _fails(capsys, args(num_generations=1), "at least 2 per prompt", "--num_generations 8")
    _fails(capsys, args(reward_funcs=None), "--method grpo needs rewards")
    _fails(capsys, args(max_seq_length=24, max_completion_length=8), "prompts are longer than",
           "raise --max_seq_length to")  # fmt: skip
    _fails(capsys, [*args(), "--dataset", str(setup["games"])], "it needs a column `prompt`")
    _fails(capsys, args(reward_funcs=f"{setup['rewards']}:wrong_length"),
           "The reward function wrong_length returned 1 values for 4 completions")  # fmt: skip
    _fails(capsys, args(reward_funcs=f"{setup['rewards']}:nan_reward"),
           "The reward function nan_reward returned nan")  # fmt: skip
    _fails(capsys, [*args(), "--method", "sft", "--dataset", str(setup["games"]),
                    "--num_generations", "4"], "option(s) of --method grpo")  # fmt: skip
    # The engine's reward takes --chess_engine's engine: off, or a path that is not one, stops.
    _fails(capsys, args(reward_funcs="chess_engine", chess_engine="off"),
           "--chess_engine off turns it off")  # fmt: skip
    _fails(capsys, args(reward_funcs="chess_engine", chess_engine=str(tmp_path / "sf")),
           f"{tmp_path / 'sf'} given by --chess_engine does not exist")  # fmt: skip
