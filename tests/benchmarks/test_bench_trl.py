"""benchmarks/bench_trl.py, its job (benchmarks/grpo_peer_job.py) and its reward: both systems are
handed the same job (model, data, reward and GRPO settings), and the figures it prints are what the
walls and tokens say."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_trl, grpo_peer_job
from examples.rewards.digit_share import digit_share, trl_digit_share
from nereus_core.config import parse_config
from nereus_core.plan import ModelStage
from nereus_core.rl.grpo import TRL_LOSS_TYPES

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The benchmark's model directory (tokenizer beside it) and GSM8K train split."""
    root = tmp_path_factory.mktemp("bench")
    tokenizer = grpo_peer_job.write_tokenizer(root / "model")
    grpo_peer_job.write_model(root / "model", tokenizer.eos_token_id)
    return root / "model", grpo_peer_job.write_data(root / "gsm8k")


def test_the_reward_counts_digits_and_trl_gets_the_same_numbers() -> None:
    assert digit_share("openai/gsm8k", "a1b2", "3", None) == 0.5
    assert digit_share("openai/gsm8k", "", "3", None) == 0.0
    assert digit_share("openai/gsm8k", "#### 72", "72", {"index": 0}) == pytest.approx(2 / 7)
    texts = ["x9", "no digits", "123"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]  # TRL's conversational form
    columns = {
        "data_source": ["openai/gsm8k"] * 3,
        "reward_model": [{"style": "rule", "ground_truth": "1"}] * 3,
        "extra_info": [{"index": i} for i in range(3)],
    }
    expected = [digit_share("openai/gsm8k", t, "1", None) for t in texts]
    assert trl_digit_share(completions, **columns) == expected == [0.5, 0.0, 1.0]
    assert trl_digit_share(texts, **columns) == expected  # plain-text completions too


def test_both_systems_are_given_the_same_job(
    job: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, train = job
    s = grpo_peer_job.Settings(steps=3)
    monkeypatch.chdir(grpo_peer_job.ROOT)  # reward.function is relative to where Nereus runs
    for slots in (1, 2):
        cfg = parse_config(grpo_peer_job.nereus_config(model_dir, train, s, slots))
        args = grpo_peer_job.trl_args(s, tmp_path)
        assert cfg.model.path is not None and Path(cfg.model.path) == model_dir
        assert cfg.data is not None and [Path(f) for f in cfg.data.train_files] == [train]
        assert cfg.data.shuffle is False and args.shuffle_dataset is False  # prompts in file order
        assert cfg.job.steps == args.max_steps == 3
        assert cfg.job.batch_size == args.per_device_train_batch_size * args.gradient_accumulation_steps
        assert cfg.algorithm.group_size == args.num_generations
        assert cfg.algorithm.scale_rewards == args.scale_rewards
        assert cfg.algorithm.loss_agg_mode == TRL_LOSS_TYPES[args.loss_type]
        assert cfg.ppo.clip_ratio == args.epsilon and cfg.algorithm.clip_ratio_high is None
        assert args.epsilon_high in (None, args.epsilon)
        assert cfg.ppo.actor_lr == args.learning_rate and args.lr_scheduler_type == "constant"
        assert cfg.ppo.temperature == args.temperature and args.top_k in (0, None) and args.top_p == 1.0
        assert cfg.job.response_len == args.max_completion_length
        # One optimizer step per generated batch on each side.
        assert (cfg.ppo.ppo_epochs, cfg.ppo.mini_batches) == (1, 1)
        assert (args.num_iterations, args.steps_per_generation) == (1, 1)
        # No KL term: TRL's beta is 0 and the Nereus job has no reference model to run.
        assert args.beta == 0.0 and ModelStage.REFERENCE_INFER not in cfg.stages
        # No gradient clipping and no weight decay on either side.
        assert cfg.ppo.grad_clip == args.max_grad_norm == 0.0 and args.weight_decay == 0.0
        assert cfg.cluster.devices == slots and not cfg.job.adapt


def test_every_prompt_fits_so_neither_system_filters(job: tuple[Path, Path]) -> None:
    model_dir, train = job
    from nereus_core.hf.tokenizer import load_tokenizer

    lengths = grpo_peer_job.prompt_lengths(load_tokenizer(model_dir), train)
    assert len(lengths) == 400  # the converter's train split of GSM8K's first 500 test problems
    assert 20 < max(lengths) <= grpo_peer_job.Settings().max_prompt_len


def test_figures_are_medians_and_token_rates() -> None:
    out = bench_trl.figures([1.0, 3.0, 2.0], [10, 20, 30], [0.1, 0.2, 0.3])
    assert out["step_s_median"] == 2.0
    assert out["tokens_per_s"] == 10.0  # 60 tokens over 6 seconds
    assert out["reward"] == [0.1, 0.2, 0.3] and out["steps"] == 3 and out["generated_tokens"] == 60


def test_rounds_are_pooled_and_ratios_are_of_medians() -> None:
    def run(walls: list[float], tokens: int) -> dict[str, object]:
        return bench_trl.figures(walls, [tokens], [0.0] * len(walls))

    rounds = [
        {"trl": run([1.0, 1.0, 2.0], 30), "nereus_1slot": run([3.0, 2.0, 4.0], 30)},
        {"trl": run([2.0, 2.0, 2.0], 30), "nereus_1slot": run([6.0, 5.0, 5.0], 30)},
    ]
    assert bench_trl.pooled(rounds, "trl") == {"step_s_median": 2.0, "tokens_per_s": 6.0}  # 60 tokens, 10 s
    nereus = bench_trl.pooled(rounds, "nereus_1slot")
    assert nereus["step_s_median"] == 4.5 and nereus["tokens_per_s"] == 2.4  # 60 tokens, 25 s
    assert nereus["step_ratio_vs_trl"] == 2.25  # 4.5 over the pooled TRL median 2.0
    assert nereus["step_ratio_vs_trl_per_round"] == [3.0, 2.5]
    # A failed run is left out, with TRL's run of that round: ratios stay within one round's load.
    rounds.append({"trl": run([9.0], 9), "nereus_1slot": {"status": "failed: worker lost"}})
    assert bench_trl.pooled(rounds, "nereus_1slot") == nereus
    assert bench_trl.pooled(rounds[2:], "nereus_1slot") == {"status": "no completed run"}
