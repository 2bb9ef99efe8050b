"""The trace-driven simulator: a PPO or GRPO job replayed step by step through the real controller and
cost model (the job's model-stages: ``SimConfig.stages``).

Boundary: a trace (devices, capacity and lengths per step) and a hidden "truth" (the world:
``world``, ``stage_world``, ``memory``, ``transitions``, ``checkpoints``, fitted to published runs and
sharing no code with the cost model) go in; per-step records and per-strategy summaries come out.
The strategies call the same ``controller``, ``plan`` and ``stage_cost`` code a running job does;
nothing here
reads files, starts processes or knows Prefect or Dask (``tasks/sim_tasks.py`` and
``flows/simulate.py`` do that).
"""
