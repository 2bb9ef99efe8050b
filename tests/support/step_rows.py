"""The (model, stage) rows of a PPO step, in the order the job flow (flows/job/rl_job.py) records them."""

from __future__ import annotations

STAGES = [
    ("actor", "generate"),
    ("task", "rule_score"),
    ("reward", "infer"),
    ("reference", "infer"),
    ("actor", "infer"),
    ("critic", "infer"),
    ("ppo", "advantages"),
    ("actor", "train"),
    ("actor", "sync"),
    ("critic", "train"),
    ("critic", "sync"),
    ("rollout", "write"),
]
