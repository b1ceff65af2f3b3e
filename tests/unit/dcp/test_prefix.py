"""Which checkpoint names carry a step. No server."""

from __future__ import annotations

import pytest

from s3ckpt.format.layout import step_of


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("run7/step-000100", 100),
        ("global_step1000", 1000),
        ("ckpt_42", 42),
        ("7", 7),
        ("a/b/step-5", 5),
        ("best-epoch3", None),  # a name that happens to end in a digit
        ("step-100-retry2", None),
        ("run-2024-06-01", None),
        ("final", None),
    ],
)
def test_a_step_is_a_word_and_a_number_or_a_number(name: str, step: int | None) -> None:
    assert step_of(name) == step
