"""The configuration as documentation and as a report, both read from the ``Settings`` model
itself: a new option appears in ``docs/configuration.md`` and in ``toolledger config`` the
moment it is declared, with its variable, default and meaning, so the docs cannot drift."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from sqlalchemy.engine import make_url

from toolledger.domain.redaction import MASK
from toolledger.settings import Settings

ENV_PREFIX = "TOOLLEDGER_"


@dataclass(frozen=True)
class Option:
    name: str
    variable: str
    type: str
    default: str
    meaning: str
    secret: bool


def options() -> list[Option]:
    """Every option of ``Settings``, in declaration order."""
    return [_option(name, field) for name, field in Settings.model_fields.items()]


def _option(name: str, field: FieldInfo) -> Option:
    annotation = str(field.annotation).replace("typing.", "")
    secret = "SecretStr" in annotation
    if field.default_factory is not None:
        default: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        default = None if field.default is PydanticUndefined else field.default
    return Option(
        name=name,
        variable=ENV_PREFIX + name.upper(),
        type=_type_name(annotation),
        default=_shown(default),
        meaning=field.description or "",
        secret=secret,
    )


def _type_name(annotation: str) -> str:
    for noise in ("<class '", "'>", "pydantic.types.", "collections.abc."):
        annotation = annotation.replace(noise, "")
    return annotation


def _shown(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, frozenset | set):
        return ", ".join(sorted(value))
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    return str(value)


def reference_markdown() -> str:
    """``docs/configuration.md``: a table of every option."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from toolledger.settings.Settings by `toolledger config --reference`;",
        "     tests/cli/test_config.py fails when this file and the model differ. -->",
        "",
        "Every option is an environment variable (or a line of a `.env` file in the working",
        'directory). Lists and maps are JSON (`TOOLLEDGER_SECRET_FIELDS=\'["password", "pin"]\'`),',
        "except `TOOLLEDGER_AGENT_IDS`: comma-separated ids.",
        "`toolledger config` prints the values in effect, secrets masked.",
        "How the intake's settings (agents, webhooks) fit together in a deployment:",
        "[deploying.md](deploying.md).",
        "",
        "| Variable | Type | Default | Meaning |",
        "|---|---|---|---|",
    ]
    for option in options():
        cells = (f"`{option.variable}`", f"`{option.type}`", f"`{option.default}`", option.meaning)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def effective(settings: Settings) -> list[dict[str, Any]]:
    """The values in effect, each with where it came from; secrets masked (the password of
    the database URL too)."""
    explicit = settings.model_fields_set
    report = []
    for option in options():
        value = getattr(settings, option.name)
        report.append(
            {
                "name": option.name,
                "variable": option.variable,
                "value": _masked(option.name, value),
                "source": "set" if option.name in explicit else "default",
            }
        )
    return report


def _masked(name: str, value: Any) -> Any:
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, dict) and any(isinstance(item, SecretStr) for item in value.values()):
        return {key: MASK for key in value}
    if name == "database_url":
        url = make_url(value)
        return url.render_as_string(hide_password=True).replace("***", MASK) if url.password else value
    if isinstance(value, frozenset | set):
        return sorted(value)
    return value
