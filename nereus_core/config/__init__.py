"""The job's configuration: frozen pydantic models that validate themselves (``NereusConfig``).

    base.py       the frozen base, errors, cluster, trainer and critic sections
    model.py      the model section (shapes, or a Hugging Face directory's config.json)
    data.py       data, reward and validation sections
    errors.py     pydantic's errors turned into one line naming the field and the fix
    rollout.py    the rollout section: Nereus's sampler or vLLM engines for actor/generate
    passes.py     the passes section: packed sequences and token-budget micro-batches
    workload.py   ``Workload``: what one step asks of every model-stage (its batch, lengths, passes)
    job.py        ``NereusConfig``, the job's whole config, and ``parse_config``
    from_yaml.py  YAML text -> ``NereusConfig``, with limits on what the text may hold

This package is the public face: callers import from ``nereus_core.config``.
"""

from nereus_core.config.base import ClusterConfig, ConfigError, name_error, shown
from nereus_core.config.job import (
    LLAMA_3_8B,
    MODEL_STAGES,
    ModelConfig,
    NereusConfig,
    RecoveryMode,
    RopeScaling,
    ScenarioEvent,
    parse_config,
    recovery_write,
    with_overrides,
)
from nereus_core.config.passes import PassesConfig
from nereus_core.config.rollout import RolloutConfig, vllm_installed
from nereus_core.config.workload import Workload, engine_kv_bytes

__all__ = [
    "LLAMA_3_8B",
    "MODEL_STAGES",
    "ClusterConfig",
    "ConfigError",
    "ModelConfig",
    "NereusConfig",
    "PassesConfig",
    "RecoveryMode",
    "RolloutConfig",
    "RopeScaling",
    "ScenarioEvent",
    "Workload",
    "engine_kv_bytes",
    "name_error",
    "parse_config",
    "recovery_write",
    "shown",
    "vllm_installed",
    "with_overrides",
]
