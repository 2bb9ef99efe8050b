"""Nereus flows: the Prefect flows (PPO and GRPO jobs, their transition subflow, simulation) and the CLI.

Flows only sequence work: they call tasks (``tasks/``), which call the pure
library (``nereus_core``) and the store (``storage``). Nothing below imports
from here.
"""
