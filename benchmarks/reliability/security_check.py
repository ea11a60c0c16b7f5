"""What a security check is: a function that returns a line of detail when its property holds and raises
SecurityCheckFailed when it does not; run_check turns it into a row of the suite's table."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ERROR_FIELDS = {"message", "type", "param", "code"}   # OpenAI's error body


@dataclass
class SecurityCheck:
    """One row of the suite's table."""
    name: str
    passed: bool
    detail: str


class SecurityCheckFailed(Exception):
    """A security property does not hold; the message says where."""


def require(condition: bool, message: str) -> None:
    """Not `assert`: the checks must also run under python -O."""
    if not condition:
        raise SecurityCheckFailed(message)


def run_check(name: str, check: Callable[..., str], *args) -> SecurityCheck:
    """A row: passed with the check's detail, or failed with what broke (an unexpected error included)."""
    try:
        return SecurityCheck(name, True, check(*args))
    except Exception as exc:   # a broken check is a failed row, not a crashed suite
        detail = str(exc) if isinstance(exc, SecurityCheckFailed) else f"{type(exc).__name__}: {exc}"
        return SecurityCheck(name, False, detail)
