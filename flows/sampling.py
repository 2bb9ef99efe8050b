"""The first part of every step, PPO's or GRPO's: sample responses on actor/generate, score them by
the task's rule. Returns the step's rollout; what follows is the algorithm's (flows/ppo_job.py,
flows/grpo_step.py)."""

from __future__ import annotations

import torch

from flows.job_records import JobRecords
from nereus_core import job as jb
from nereus_core import rollout as ro
from nereus_core.plan import ModelStage
from nereus_core.task import rule_score
from tasks import ppo_stages as st
from tasks.device_pool import DevicePool


def sample_rollout(
    pool: DevicePool,
    state: jb.JobState,
    records: JobRecords,
    step: int,
    prompts: torch.Tensor,
    stopping: ro.Stopping = ro.NO_STOP,
) -> ro.Rollout:
    """Responses to ``prompts`` from actor/generate (one generator per replica: every row, copies
    of one prompt included, draws its own tokens), each stopping at a stop id of ``stopping`` or
    at the limit (none for the count task: every response has the full length), with the task's
    rule score."""
    cfg, pid = state.config, state.plan_id
    b, t_len = prompts.shape[0], cfg.job.response_len
    with records.task_call(step, pid) as call:
        responses, s = st.generate(
            pool,
            state.layouts[ModelStage.ACTOR_GENERATE],
            prompts,
            name="actor/generate",
            max_new_tokens=t_len,
            temperature=cfg.ppo.temperature,
            seed=cfg.job.seed * 7919 + step,
            stopping=stopping,
        )
        mask = ro.response_mask(responses, stopping.eos_ids)
        call.add("actor", "generate", int(mask.sum()), s)
    r = ro.Rollout(prompts=prompts, responses=responses, mask=mask)
    with records.plain(step, pid, "task", "rule_score", b):
        r.rule_score = rule_score(prompts, responses)
    return r
