"""Which role versions a node can serve: what the `weights` stream announced per role, what the
engine serves as each role's newest, and the request-model-name lookup built on both.

A request's `model` is the node's served name (or `policy`), a trained role, or either with
`@version`. The served name means the `policy` role, so a single-policy run reads as before;
a role with nothing published yet (version 0) is the base model. An older version stays
servable while its adapter folder is on disk (the trainer prunes a version only after every
node acknowledged a newer one); after that a request for it gets an error naming the role,
the version and the versions that exist.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from squall.shared.roles import DEFAULT_ROLE, split_model


class ModelUnavailable(LookupError):
    """A request named a model this node cannot serve; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Announced:
    """One published version of a role, as the `weights` stream said it."""

    folder: str
    checksum: str
    format: str


class AdapterCatalog:
    """Thread-safe: the follower writes, request handlers and the engine thread read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.announced: dict[str, dict[int, Announced]] = {}  # role -> version -> where
        self.newest: dict[str, int] = {DEFAULT_ROLE: 0}  # role -> version served for `role`

    def announce(self, role: str, version: int, folder: str, checksum: str, format: str) -> None:
        with self._lock:
            self.announced.setdefault(role, {})[version] = Announced(folder, checksum, format)

    def serve(self, role: str, version: int) -> None:
        with self._lock:
            self.newest[role] = version

    def roles(self) -> list[str]:
        with self._lock:
            return sorted(set(self.newest) | set(self.announced))

    def lookup(self, role: str, version: int) -> Announced | None:
        with self._lock:
            return self.announced.get(role, {}).get(version)

    def on_disk(self, role: str) -> list[int]:
        """The versions of `role` servable now: its newest, version 0 (the base), and every
        announced version whose folder still exists."""
        with self._lock:
            announced = dict(self.announced.get(role, {}))
            newest = self.newest.get(role, 0)
        kept = {v for v, a in announced.items() if Path(a.folder).exists()}
        return sorted(kept | {0, newest})

    def resolve(self, model: str, served_name: str) -> tuple[str, int | None]:
        """(role, version or None for the newest) of a request's model name, else
        ModelUnavailable naming what exists."""
        try:
            role, version = split_model(model)
        except ValueError as exc:
            raise ModelUnavailable(400, str(exc)) from None
        if role in (served_name, DEFAULT_ROLE):
            role = DEFAULT_ROLE
        known = self.roles()
        if role not in known:
            names = [served_name, *(r for r in known if r != DEFAULT_ROLE)]
            raise ModelUnavailable(
                404,
                f"model {model!r} is not served here; this node serves {', '.join(repr(n) for n in names)} "
                "(a trained role, optionally '@version')",
            )
        if version is not None and version not in self.on_disk(role):
            raise ModelUnavailable(
                404,
                f"model {model!r}: version {version} of role {role!r} is not available on this node "
                f"(never published, or its files were pruned); versions available: {self.on_disk(role)}",
            )
        return role, version
