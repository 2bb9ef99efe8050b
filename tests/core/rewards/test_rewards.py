"""The built-in scorers on hand-written cases (verl's rules and their known edge cases) and the
reward registry: built-ins, a user's file, and each way loading or calling one can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_core import count_task as task
from nereus_core.rewards import (
    RewardError,
    gsm8k,
    math_answer,
    resolve,
    score_text,
    score_tokens,
    spec_problem,
)
from nereus_core.rewards.isolation import WorkerSettings
from nereus_core.rewards.registry import form_problem, load_problem


@pytest.mark.parametrize(
    ("text", "truth", "strict", "flexible"),
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
        ("#### 1,234", "1234", 1.0, 0.0),  # strict drops commas; flexible keeps "1,234" as verl does
        ("#### -3", "-3", 1.0, 1.0),
        ("#### 5\nwait, no\n#### 6", "6", 1.0, 1.0),  # the last #### answer counts
        ("#### 5\nwait, no\n#### 6", "5", 0.0, 0.0),
        ("The answer is 18.", "18", 0.0, 0.0),  # no ####; flexible finds "18." (verl keeps the dot)
        ("The answer is 18", "18", 0.0, 1.0),
        ("####18", "18", 0.0, 1.0),  # strict wants "#### " with the space
        ("#### $5", "5", 0.0, 1.0),  # no number right after "#### "
        ("no number here", "1", 0.0, 0.0),
        ("", "1", 0.0, 0.0),
        ("#### 7", 7, 1.0, 1.0),  # a numeric ground truth compares as its string
        ("#### 7.0", "7", 0.0, 0.0),  # string equality: 7.0 is not 7
    ],
)
def test_gsm8k_strict_and_flexible(text: str, truth: object, strict: float, flexible: float) -> None:
    assert gsm8k.score(text, truth, "strict") == strict
    assert gsm8k.score(text, truth, "flexible") == flexible


def test_gsm8k_reads_only_the_last_300_characters() -> None:
    early = "#### 42" + " filler" * 60  # the answer is more than 300 characters from the end
    assert len(early) - early.index("42") > gsm8k.CLIP_CHARS
    assert gsm8k.score(early, "42") == 0.0
    assert gsm8k.score("x" * 1000 + "#### 42", "42") == 1.0


def test_gsm8k_ground_truth_is_the_number_after_hashes() -> None:
    assert gsm8k.ground_truth("She makes $18.\n#### 18") == "18"
    assert gsm8k.ground_truth("so 1,200 in all\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        gsm8k.ground_truth("an answer without the marker")


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so $\\boxed{5}$.", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces balanced
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last box
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\fbox{3}", "3"),
        ("$\\boxed 7$ done", "7"),
        ("\\boxed{5", None),  # unclosed
        ("no box", None),
        ("\\boxed", None),
    ],
)
def test_math_last_boxed(text: str, boxed: str | None) -> None:
    assert math_answer.last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("0.5", "\\frac12"),
        (".5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("10\\text{ cm}", "10"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("\\$18.90", "18.90"),
        ("50\\%", "50"),
        ("x = 5", "5"),
        ("k=5", "5"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("007", "7"),
        ("5.", "5"),  # the trailing period rule
        ("\\!1\\!000", "1000"),
        ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
    ],
)
def test_math_equivalent_forms(answer: str, truth: str) -> None:
    assert math_answer.is_equiv(answer, truth), (math_answer.normalize(answer), math_answer.normalize(truth))
    assert math_answer.score(f"... so the answer is $\\boxed{{{answer}}}$.", truth) == 1.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("\\frac{2}{4}", "\\frac{1}{2}"),  # string equivalence, not value: as verl
        ("1,000", "1000"),  # commas stay
        ("6", "7"),
        ("x+1", "1+x"),
        ("\\frac{1}{2}", "0.50"),
    ],
)
def test_math_different_forms(answer: str, truth: str) -> None:
    assert not math_answer.is_equiv(answer, truth)
    assert math_answer.score(f"\\boxed{{{answer}}}", truth) == 0.0


def test_math_score_needs_a_box() -> None:
    assert math_answer.score("the answer is 5", "5") == 0.0
    assert math_answer.score("\\boxed{5", "5") == 0.0
    assert math_answer.is_equiv(None, None) and not math_answer.is_equiv(None, "5")
    assert math_answer.normalize("") == ""


def test_builtins_have_verls_signature() -> None:
    for name, text, truth in (("gsm8k", "#### 3", "3"), ("math", "\\boxed{3}", "3")):
        reward = resolve(name)
        assert reward.inputs == "text"
        assert score_text(reward, "src", text, truth, {}).score == 1.0
        assert score_text(reward, "src", "nothing", truth, {}).score == 0.0
    assert score_text(resolve("gsm8k_flexible"), "src", "it is 3", "3", None).score == 1.0


def test_count_is_task_rule_score() -> None:
    reward = resolve("count")
    assert reward.fn is task.rule_score and reward.inputs == "tokens"
    prompts = task.digit_token(torch.tensor([[1, 2]]))
    right = task.digit_token(torch.tensor([[3, 4, 5]]))
    assert float(score_tokens(reward, prompts, right)[0]) == 1.0
    with pytest.raises(RewardError, match="scores token ids"):
        score_text(reward, "src", "text", "1", {})
    with pytest.raises(RewardError, match="scores text"):
        score_tokens(resolve("math"), prompts, right)


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return path


def test_user_function_float_and_dict(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "def exact(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
        "def detailed(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'length': len(solution_str), 'source': data_source}\n",
    )
    exact = resolve(f"{path}:exact")
    assert score_text(exact, "s", " 4 ", "4", {}).score == 1.0
    assert score_text(exact, "s", "5", "4", {}).score == 0.0
    scored = score_text(resolve(f"{path}:detailed"), "src", "abc", "x", {})
    assert scored.score == 0.5 and scored.extras == {"length": 3, "source": "src"}


@pytest.mark.parametrize(
    ("body", "name", "message"),
    [
        ("def f(a, b, c, d): return 1.0\n", "g", "has no function 'g'"),
        ("f = 3\n", "f", "is a int, not a function"),
        ("def f(a, b): return 1.0\n", "f", "cannot be called as fn(data_source, solution_str"),
        ("raise ImportError('needs sympy')\n", "f", "raised ImportError: needs sympy"),
        ("def f(:\n", "f", "raised SyntaxError"),
    ],
)
def test_user_function_load_errors(tmp_path: Path, body: str, name: str, message: str) -> None:
    path = _write(tmp_path, "open(__file__ + '.ran', 'w').close()\n" + body)
    problem = load_problem(f"{path}:{name}", WorkerSettings())
    assert problem is not None and message in problem and "\n" not in problem, problem
    # Found by a worker process, which imported the file; this process never did.
    ran = (tmp_path / "my_reward.py.ran").exists()
    assert ran == ("SyntaxError" not in message) and "my_reward" not in str(sorted(sys.modules))
    log = problem.rpartition("(worker log: ")[2].removesuffix(")")
    assert Path(log).is_file()  # kept for the user: the error line names it
    Path(log).unlink()


def test_user_file_missing_or_malformed_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve(f"{tmp_path}/nope.py:f")
    (tmp_path / "d.py").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        resolve(f"{tmp_path}/d.py:f")
    assert "neither a built-in" in (spec_problem("gsm9k") or "")
    assert "not a .py file" in (spec_problem("rewards.txt:f") or "")
    assert "not a Python function name" in (spec_problem("r.py:1f") or "")
    assert spec_problem("math") is None and form_problem("dir/r.py:f") is None
    assert "dir/r.py does not exist" in (spec_problem("dir/r.py:f") or "")  # looked at, not imported


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "    raise KeyError('ground_truth missing')\n",
            "reward function .*:f raised KeyError: 'ground_truth missing'",
        ),
        ("    return 'high'\n", "returned str 'high'"),
        ("    return {'acc': 1.0}\n", "without a 'score' key"),
        ("    return float('nan')\n", "returned float"),
    ],
)
def test_user_function_failing_during_a_step(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, "def f(data_source, solution_str, ground_truth, extra_info):\n" + body)
    reward = resolve(f"{path}:f")
    with pytest.raises(RewardError, match=message) as err:
        score_text(reward, "src", "text", "1", {})
    assert "\n" not in str(err.value)


TEXT = st.text(alphabet=st.sampled_from(list("0123456789.,-$# {}\\boxedfrac^_=/%xk\n")), max_size=80)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, truth=TEXT)
def test_scorers_never_raise_on_any_text(text: str, truth: str) -> None:
    assert gsm8k.score(text, truth, "strict") in (0.0, 1.0)
    assert gsm8k.score(text, truth, "flexible") in (0.0, 1.0)
    assert math_answer.score(text, truth) in (0.0, 1.0)
