"""Prompt data sets in verl's format: rows (``rows``), the max-prompt-length policy
(``prompt_length``), batches by step (``sampler``) and the GSM8K/MATH500 conversion (``convert``).

Boundary: pure; the Parquet/JSONL reader and writer are ``storage/datasets.py``.
"""

from __future__ import annotations

from nereus_core.dataset.prompt_length import LengthReport, PromptTokenizer, apply_max_prompt_length
from nereus_core.dataset.rows import REQUIRED_COLUMNS, Example, column_problem, parse_rows
from nereus_core.dataset.sampler import Sampler

__all__ = [
    "REQUIRED_COLUMNS",
    "Example",
    "LengthReport",
    "PromptTokenizer",
    "Sampler",
    "apply_max_prompt_length",
    "column_problem",
    "parse_rows",
]
