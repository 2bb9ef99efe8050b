"""A model's tokenizer: loaded from its directory, chat prompts rendered to token ids, and the ids
that end a response.

Boundary: the driver's side of text. The engines know nothing about tokenization: they take and
return token ids; this module turns chat messages (verl's ``prompt`` column: a list of
``{"role", "content"}``) into those ids with the tokenizer's own chat template
(``apply_chat_template(..., add_generation_prompt=True)``, as verl renders prompts), and says which
ids stop generation: ``tokenizer.eos_token_id`` and the ``eos_token_id`` of the model's
``generation_config.json`` (one id or a list: Llama 3 Instruct ends a turn with ``<|eot_id|>``,
Qwen2 Instruct with ``<|im_end|>``, beside their end-of-text token). A problem is a
``TokenizerError`` of one line naming the directory and the fix.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What a saved tokenizer leaves: a fast tokenizer's tokenizer.json, or a tokenizer_config.json that
# names a slow one's vocabulary files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves the chat template
GENERATION_CONFIG = "generation_config.json"
RENDER_LIMIT_S = 5.0  # one prompt's rendering; a real template takes well under a millisecond

Messages = Sequence[Mapping[str, str]]


class TokenizerError(ValueError):
    """A tokenizer Nereus cannot use; ``str(err)`` is one line naming the directory and the fix."""


def tokenizer_error(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` holds no tokenizer (a missing directory or files), or None. Reads no tokenizer."""
    root = Path(path)
    if not root.is_dir():
        return f"tokenizer directory {path} not found"
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"{path} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}); save one there with "
            "tokenizer.save_pretrained, or set model.tokenizer to a directory that has one"
        )
    return None


def chat_template_error(path: str | os.PathLike[str]) -> str | None:
    """Why the tokenizer in ``path`` cannot render chat messages (no tokenizer, no chat template), or
    None; for config load, before anything starts (reads files, loads no tokenizer)."""
    problem = tokenizer_error(path)
    if problem:
        return problem
    root = Path(path)
    if (root / TEMPLATE_FILE).is_file():
        return None
    try:
        settings = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        settings = {}
    if isinstance(settings, dict) and settings.get("chat_template"):
        return None
    return _no_template(path)


def _no_template(path: object) -> str:
    return (
        f"the tokenizer in {path} has no chat template, but the prompts are chat messages; use a "
        f"tokenizer with one ({TEMPLATE_FILE} or tokenizer_config.json's chat_template), "
        "or plain-text prompts"
    )


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``path`` (``AutoTokenizer``, local files only: nothing is downloaded)."""
    from transformers import AutoTokenizer

    problem = tokenizer_error(path)
    if problem:
        raise TokenizerError(problem)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TokenizerError(f"{path}: the tokenizer does not load: {first}") from None


class _RenderTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise ``_RenderTimeout`` in this thread after ``seconds`` (SIGALRM; only the main thread can
    take a signal, so elsewhere there is no limit). A chat template is code from the model's files:
    a loop in it would otherwise stall the start for good."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise _RenderTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Messages]) -> list[list[int]]:
    """Token ids of each conversation rendered by the tokenizer's chat template, ending with the
    assistant's turn opened (``add_generation_prompt=True``): what the actor continues.
    TokenizerError (one line) if the template raises, runs past ``RENDER_LIMIT_S`` or renders no
    token (the caller names the row)."""
    if not tokenizer.chat_template:
        raise TokenizerError(_no_template(tokenizer.name_or_path or "this directory"))
    out = []
    for messages in conversations:
        try:
            with _time_limit(RENDER_LIMIT_S):
                ids = tokenizer.apply_chat_template(
                    [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
                )
        except _RenderTimeout:
            raise TokenizerError(
                f"the chat template of {tokenizer.name_or_path} ran past {RENDER_LIMIT_S:g} s on one "
                "prompt (a loop in the template?); fix the template"
            ) from None
        except Exception as err:  # the template is the model's code: any error, as one line
            first = (str(err).strip().splitlines() or ["(no message)"])[0]
            raise TokenizerError(
                f"the chat template of {tokenizer.name_or_path} raised {type(err).__name__}: {first}"
            ) from None
        if not ids:
            raise TokenizerError(
                f"the chat template of {tokenizer.name_or_path} renders an empty prompt; "
                "fix the template or the row's messages"
            )
        out.append([int(i) for i in ids])
    return out


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, model_dir: str | os.PathLike[str] | None
) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS, then those of ``model_dir``'s
    generation_config.json (if it has one), each once, in that order."""
    ids: list[int] = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids.extend(_generation_eos(Path(model_dir) / GENERATION_CONFIG) if model_dir is not None else [])
    if not ids:
        raise TokenizerError(
            f"{tokenizer.name_or_path}: no EOS token (neither the tokenizer's eos_token nor "
            f"{GENERATION_CONFIG}'s eos_token_id); responses could never end"
        )
    return tuple(dict.fromkeys(ids))


def pad_token_id(tokenizer: PreTrainedTokenizerBase, stop_ids: Sequence[int]) -> int:
    """The id that pads prompts (left) and responses (right): the tokenizer's pad token, else the
    first stop id (verl sets ``pad_token = eos_token`` when a tokenizer has none; masks keep pads out
    of every result)."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else int(stop_ids[0])


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The characters of the tokenizer's longest token: a text of more than ``n * this`` characters
    has more than ``n`` tokens, known without tokenizing it (a 10 MB prompt takes a minute)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """A response's text for the reward: its ids decoded with the special tokens skipped (as verl)."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


def vocab_problem(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> str | None:
    """Why the model cannot take every id of ``tokenizer`` (its ids reach past ``vocab_size``), or None."""
    size = len(tokenizer)
    if size > vocab_size:
        return (
            f"the tokenizer {tokenizer.name_or_path} has {size} tokens but model.vocab_size={vocab_size}; "
            "use the model's own tokenizer (model.tokenizer) or a model with a larger vocabulary"
        )
    return None


def _generation_eos(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        raw: Any = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise TokenizerError(f"{path} is not readable JSON: {err}") from None
    if raw is None:
        return []
    values = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: eos_token_id={raw!r} is not a token id or a list of them")
    return list(values)
