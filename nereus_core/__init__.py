"""Nereus core: the pure library (config, plans, model, parallel, engines, PPO, transitions).

It imports torch, numpy, pydantic and deepspeed, never prefect, dask, pyarrow or
the ``storage`` package; paths and settings are passed in by the outer layers.
"""

__version__ = "0.1.0"
