"""Trained roles: the names a run's policies go by, on the wire and in requests.

A run trains one or more roles. A single-policy run has exactly one, `policy`, and every
message, hash field and model name reads as it did before roles existed. A run with several
roles gives each its own weights (a LoRA adapter on one shared base), its own version counter
and its own `versions` hash fields. A request names what it wants served through its `model`
field: `role` (that role's newest version) or `role@version` (exactly that version).
"""

from __future__ import annotations

import re

from .errors import ConfigError

DEFAULT_ROLE = "policy"
ROLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def check_role_name(name: str, where: str) -> str:
    """`name` if it can name a role (a letter, then letters, digits, '_' or '-'; no '@' or ':',
    which separate versions and hash fields); else a ConfigError naming `where`."""
    if not ROLE_NAME.match(name):
        raise ConfigError(
            f"{where}: {name!r} cannot name a role: use a letter, then letters, digits, '_' or '-' "
            "(at most 64 characters)"
        )
    return name


def split_model(model: str) -> tuple[str, int | None]:
    """A request's model name as (role, version): 'wolves' -> ('wolves', None), 'wolves@7' ->
    ('wolves', 7). A version that is not a whole number is a ValueError naming the text."""
    role, sep, version = model.rpartition("@")
    if not sep:
        return model, None
    if not version.isdigit():
        raise ValueError(f"model {model!r}: the text after '@' must be a version number, e.g. {role}@3")
    return role, int(version)


def trainer_field(role: str) -> str:
    """The `versions` hash field holding the role's last published version."""
    return "trainer" if role == DEFAULT_ROLE else f"trainer:{role}"


def node_field(node: str, role: str) -> str:
    """The `versions` hash field holding the version of `role` node `node` serves."""
    return f"inference:{node}" if role == DEFAULT_ROLE else f"inference:{node}:{role}"
