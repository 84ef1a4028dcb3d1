"""One grammar for argument checks: ``"<name> must be <rule>, got <value>"``.

Every check raises :class:`~nn_handler.errors.ConfigurationError`, which is
also a :class:`ValueError`, so callers that catch either keep working. A check
returns the value it accepted, so a constructor can check and assign in one
line. Type checks of objects (``model must be a torch.nn.Module``) stay
``TypeError`` at their call sites; these helpers are for settings.

Example:
    >>> check_int("grad_accum_steps", 4, minimum=1)
    4
    >>> check_int("grad_accum_steps", 0, minimum=1)
    Traceback (most recent call last):
    ...
    nn_handler.errors.ConfigurationError: grad_accum_steps must be an int >= 1, got 0
"""

from __future__ import annotations

from typing import Any, Iterable

from .errors import ConfigurationError

__all__ = ["invalid", "check_int", "check_number", "check_choice", "check_bool"]


def invalid(name: str, rule: str, value: Any, hint: str | None = None) -> ConfigurationError:
    """The error for a setting that breaks ``rule``; for checks the helpers below do not cover.

    Example:
        >>> str(invalid("resume", "None, 'auto' or a checkpoint path", 3))
        "resume must be None, 'auto' or a checkpoint path, got 3"
        >>> str(invalid("backend", "one of 'gloo', 'nccl' or None", "tcp", hint="None picks one for the device"))
        "backend must be one of 'gloo', 'nccl' or None, got 'tcp'; None picks one for the device"
    """
    return ConfigurationError(f"{name} must be {rule}, got {value!r}" + (f"; {hint}" if hint else ""))


def _or_none(rule: str, allow_none: bool) -> str:
    return f"{rule} or None" if allow_none else rule


def check_int(name: str, value: Any, minimum: int | None = None, *, allow_none: bool = False) -> Any:
    """``value`` when it is an int (not a bool) and at least ``minimum``.

    Example:
        >>> check_int("patience", 0, minimum=0)
        0
        >>> check_int("chunksize", True, minimum=1)
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: chunksize must be an int >= 1, got True
    """
    if value is None and allow_none:
        return value
    # bool is an int subclass, but True for a count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        rule = "an int" if minimum is None else f"an int >= {minimum}"
        raise invalid(name, _or_none(rule, allow_none), value)
    return value


def check_number(name: str, value: Any, minimum: float = 0, *, strict: bool = True, unit: str = "",
                 allow_none: bool = False) -> Any:
    """``value`` when it is an int or float (not a bool) above ``minimum`` (``strict``) or at least it.

    Args:
        name: The setting's name, as the caller wrote it.
        value: What the caller gave.
        minimum: The bound.
        strict: ``True`` for ``> minimum``, ``False`` for ``>= minimum``.
        unit: Named in the message: ``"seconds"`` reads "a number of seconds > 0".
        allow_none: Accept ``None`` too.

    Example:
        >>> check_number("timeout", 2.5, unit="seconds", allow_none=True)
        2.5
        >>> check_number("keep_alive", -1, strict=False, unit="seconds")
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: keep_alive must be a number of seconds >= 0, got -1
    """
    if value is None and allow_none:
        return value
    # `not value > minimum` rather than `value <= minimum`: NaN fails it too.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (value > minimum if strict else value >= minimum)):
        rule = f"a number{f' of {unit}' if unit else ''} {'>' if strict else '>='} {minimum}"
        raise invalid(name, _or_none(rule, allow_none), value)
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any], *, allow_none: bool = False,
                 hint: str | None = None) -> Any:
    """``value`` when it is one of ``choices``.

    Example:
        >>> check_choice("mode", "max", ("min", "max"))
        'max'
        >>> check_choice("strategy", "auto", ("balanced", "sequential"))
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: strategy must be one of 'balanced', 'sequential', got 'auto'
    """
    choices = tuple(choices)
    if value is None and allow_none:
        return value
    try:
        ok = value in choices
    except TypeError:  # an unhashable value against a set or dict of choices
        ok = False
    if not ok:
        raise invalid(name, _or_none(f"one of {', '.join(map(repr, choices))}", allow_none), value, hint)
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is ``True`` or ``False`` (not 0, 1 or ``"yes"``).

    Example:
        >>> check_bool("overwrite", "yes")
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: overwrite must be True or False, got 'yes'
    """
    if not isinstance(value, bool):
        raise invalid(name, "True or False", value)
    return value
