"""What a newcomer running the trainers sees: PPO's own flags (and wording), the value loss on the
console line, a run-level progress bar with ETA, no wandb deprecation warning, and a curves.png that
says where an exact-zero mismatch was drawn."""

from __future__ import annotations

import pytest

import trainers.ppo as ppo_module
from trainers.config import PPOConfig, RLConfig
from trainers.grpo import GRPOTrainer
from trainers.metrics import ZERO_FLOOR, MetricsLogger, mismatch_series
from trainers.ppo import PPOTrainer


def _help(trainer_cls) -> str:
    """The --help text `python -m trainers.<x>` prints (run_cli builds the parser from config_cls)."""
    return " ".join(trainer_cls.config_cls.parser("").format_help().split())  # argparse wraps lines


def test_ppo_help_has_its_own_knobs_and_wording():
    """trainers.ppo --help lists --gamma, --gae-lambda, --value-lr, --vf-coef and describes --group-size
    without GRPO; trainers.grpo --help has none of PPO's knobs."""
    ppo, grpo = _help(PPOTrainer), _help(GRPOTrainer)
    for flag in ("--gamma", "--gae-lambda", "--value-lr", "--vf-coef", "--no-progress"):
        assert flag in ppo, flag
    group = ppo.rsplit("--group-size GROUP_SIZE", 1)[1].split("--", 1)[0]  # its help, after the usage line
    assert "GRPO" not in group and "samples per prompt" in group, group
    assert "--gamma" not in grpo and "--value-lr" not in grpo


@pytest.mark.parametrize("field,value,flag", [("gamma", 1.5, "--gamma"), ("gae_lambda", -0.1, "--gae-lambda"),
                                              ("value_lr", -1.0, "--value-lr"), ("vf_coef", -0.5, "--vf-coef")])
def test_ppo_knobs_are_validated_by_flag_name(field, value, flag):
    """Out-of-range PPO knobs are refused with a message naming the flag."""
    with pytest.raises(ValueError, match=flag):
        PPOConfig(**{field: value})


def test_group_size_floor_is_the_algorithms():
    """GRPO needs a group of 2+ (its baseline is the group): 1 is refused naming --group-size and why; PPO takes
    one sample per prompt (its baseline is the value head) and refuses only 0."""
    with pytest.raises(ValueError, match="--group-size must be >= 2 .GRPO"):
        RLConfig(group_size=1)
    assert PPOConfig(group_size=1).group_size == 1
    with pytest.raises(ValueError, match="--group-size must be >= 1"):
        PPOConfig(group_size=0)


def test_ppo_knobs_reach_the_loop_and_console_line_and_progress_bar(ckpt_factory, tmp_path, monkeypatch, capsys):
    """--gamma / --gae-lambda reach GAE, --value-lr is the value head's learning rate, the console line
    carries value_loss, and the run prints a progress bar (steps, ETA) on stderr."""
    seen = []
    real_gae = ppo_module.gae

    def recording_gae(*args, **kwargs):
        seen.append((kwargs["gamma"], kwargs["lam"]))
        return real_gae(*args, **kwargs)

    monkeypatch.setattr(ppo_module, "gae", recording_gae)
    # One sample per prompt, PPO's usual setting (the value head is the baseline; GRPO needs a group of 2+).
    cfg = PPOConfig(model=str(ckpt_factory("llama")), steps=2, prompts_per_step=2, group_size=1, no_wandb=True,
                    eval_every=0, output_dir=str(tmp_path / "run"), gamma=0.9, gae_lambda=0.5, value_lr=0.05)
    trainer = PPOTrainer(cfg)
    try:
        assert [g["lr"] for g in trainer.optimizer.param_groups] == [cfg.lr, 0.05]
        assert trainer.optimizer.param_groups[1]["params"] == list(trainer.value_head.parameters())
        history = trainer.train()
    finally:
        trainer.close()
    assert seen == [(0.9, 0.5)] * 2
    out, err = capsys.readouterr()
    step_lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(step_lines) == 2
    for line, m in zip(step_lines, history):
        assert f"value_loss {m['value_loss']:.4f}" in line
    assert "run: 100%" in err and "2/2" in err and "<" in err, err  # tqdm: elapsed<remaining


def test_ppo_trainer_accepts_a_plain_rlconfig(ckpt_factory, tmp_path):
    """PPOTrainer(RLConfig(...)) runs with PPO's default knobs (what the GRPO-era callers pass)."""
    cfg = RLConfig(model=str(ckpt_factory("llama")), steps=1, prompts_per_step=2, group_size=2, no_wandb=True,
                   eval_every=0, output_dir=str(tmp_path / "run"))
    trainer = PPOTrainer(cfg)
    try:
        assert isinstance(trainer.cfg, PPOConfig) and trainer.cfg.gae_lambda == 0.95 and trainer.cfg.gamma == 1.0
    finally:
        trainer.close()


def test_wandb_run_starts_without_deprecation_warning(tmp_path, monkeypatch, capfd):
    """An offline wandb run starts and logs with no 'deprecated' warning (the current reinit API)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(tmp_path, {"x": 1}, use_wandb=True, project="test")
    try:
        assert logger.wandb_run is not None
    finally:
        logger.close()
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "deprecated" not in text.lower() and "wandb disabled" not in text, text


def test_zero_mismatch_is_named_on_the_log_plot(tmp_path):
    """Exact-zero mismatches are lifted to the floor and the legend note says how many and where; no
    note when none is zero; the plot is written."""
    lifted, note = mismatch_series([0.0, 3e-7, 0.0])
    assert lifted == [ZERO_FLOOR, 3e-7, ZERO_FLOOR]
    assert note is not None and "exactly 0 at 2 of 3" in note and f"{ZERO_FLOOR:g}" in note
    assert mismatch_series([1e-7, 2e-7]) == ([1e-7, 2e-7], None)
    logger = MetricsLogger(tmp_path, {}, use_wandb=False, project="test")
    logger.history = [{"step": 1, "reward_mean": 0.5, "logprob_mismatch": 0.0},
                      {"step": 2, "reward_mean": 0.6, "logprob_mismatch": 1e-7}]
    path = logger.plot()
    logger.close()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, needle", [
    (["--tp-size", "3"], "tp_size=3 does not divide num_attention_heads"),
    (["--device", "cuda"], "CUDA is not available"),
])
def test_an_option_the_engine_refuses_is_one_line_not_a_traceback(ckpt_factory, tmp_path, capsys, argv, needle):
    """A flag the config accepts but the engine or machine refuses (run_cli builds the trainer) ends the CLI with
    exit status 2 and one `error: ...` line naming it, as the config's own checks do (it was a traceback)."""
    from trainers.grpo import run_cli

    base = ["--model", str(ckpt_factory("llama")), "--no-wandb", "--no-progress", "--steps", "1",
            "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(GRPOTrainer, base + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and needle in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_a_task_whose_prompts_outgrow_the_context_is_refused_before_any_engine(tmp_path, capsys, monkeypatch):
    """--task math on the demo model (a 128-token context, prompts of ~150 tokens): one `error:` line naming --task
    and both lengths, before an engine is built (it failed at the first eval, after start-up)."""
    from pathlib import Path

    import trainers.grpo as grpo_module

    built = []
    monkeypatch.setattr(grpo_module, "make_engine", lambda cfg: built.append(cfg))
    demo = Path(__file__).resolve().parents[2] / "assets" / "demo-model"
    with pytest.raises(SystemExit) as exit_info:
        grpo_module.run_cli(GRPOTrainer, ["--model", str(demo), "--task", "math", "--no-wandb", "--no-progress",
                                          "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and not built
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "--task math" in err and "context holds 128" in err, err
