"""GSM8K and MATH500 records made into rows of verl's format, and the rule that splits them.

The rows follow verl's ``examples/data_preprocess/gsm8k.py`` and ``math_dataset.py``: one user
message, the question followed by an instruction; ``reward_model = {style: rule, ground_truth}``;
``extra_info`` with the split, the index and the raw text. Ground truths: GSM8K's is the number after
``####`` in the reference answer, commas removed (``rewards.gsm8k.ground_truth``); MATH500's is its
``answer`` field as is (verl takes the boxed answer of the solution, which MATH500 gives as ``answer``).

Only the test splits of both data sets ship with the project, so they are split again, by a fixed
rule: the record at 0-based position ``i`` goes to ``test`` when ``i % TEST_EVERY == 0`` (one in five,
spread over the file) and to ``train`` otherwise. The rule is deterministic and needs no seed.

Boundary: records (dicts) in, rows (dicts) out; reading and writing files is ``storage/datasets.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nereus_core.rewards import gsm8k

TEST_EVERY = 5
GSM8K_SOURCE = "openai/gsm8k"
MATH500_SOURCE = "HuggingFaceH4/MATH-500"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def split_of(position: int) -> str:
    """``test`` or ``train`` for the record at 0-based ``position`` (the rule above)."""
    return "test" if position % TEST_EVERY == 0 else "train"


def _field(record: Mapping[str, Any], name: str, position: int) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"record {position}: field {name!r} is missing or not text")
    return value


def _verl_row(source: str, content: str, truth: str, position: int, **extra: Any) -> dict[str, Any]:
    """The row every data set makes (the module docstring): ``content``, the user's message;
    ``extra``, the data set's own fields of ``extra_info`` after the split and the index."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split_of(position), "index": position, **extra},
    }


def gsm8k_row(record: Mapping[str, Any], position: int) -> dict[str, Any]:
    """A verl row of one GSM8K record ``{question, answer}``."""
    question, answer = _field(record, "question", position), _field(record, "answer", position)
    try:
        truth = gsm8k.ground_truth(answer)
    except ValueError as err:
        raise ValueError(f"record {position}: {err}") from None
    return _verl_row(
        GSM8K_SOURCE, f"{question} {GSM8K_INSTRUCTION}", truth, position, answer=answer, question=question
    )


def math500_row(record: Mapping[str, Any], position: int) -> dict[str, Any]:
    """A verl row of one MATH500 record ``{problem, answer, subject, level, unique_id}``."""
    problem, answer = _field(record, "problem", position), _field(record, "answer", position)
    return _verl_row(
        MATH500_SOURCE,
        f"{problem} {MATH_INSTRUCTION}",
        answer,
        position,
        subject=str(record.get("subject", "")),
        level=int(record.get("level") or 0),
        unique_id=str(record.get("unique_id", "")),
    )


CONVERTERS: dict[str, Callable[[Mapping[str, Any], int], dict[str, Any]]] = {
    "gsm8k": gsm8k_row,
    "math500": math500_row,
}


def convert(name: str, records: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "test": rows}`` of data set ``name``'s records, split by ``split_of``."""
    make = CONVERTERS[name]
    out: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for position, record in enumerate(records):
        row = make(record, position)
        out[row["extra_info"]["split"]].append(row)
    return out


__all__ = [
    "CONVERTERS",
    "GSM8K_INSTRUCTION",
    "MATH_INSTRUCTION",
    "TEST_EVERY",
    "convert",
    "gsm8k_row",
    "math500_row",
    "split_of",
]
