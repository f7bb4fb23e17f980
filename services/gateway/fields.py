"""What the request Structs share: the strict base and the `NotYet` mark for recognised fields
Rill does not honour yet (services/gateway/requests.py reads the marks)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from rill.services.gateway.errors import APIError


class Body(Struct, forbid_unknown_fields=True):
    """A request object: an unknown key is a 400 that names it."""


def _kind(value: Any) -> type:
    return float if type(value) is int else type(value)


class NotYet:
    """Marks a field Rill recognises but does not honour yet (`Annotated[Any, NotYet(...)]`).

    null and the `no_ops` (values that ask for what Rill does anyway) are accepted; anything
    else is a 400 that names the field and says why."""

    def __init__(self, why: str, *no_ops: Any) -> None:
        self.why = why
        self.no_ops = no_ops

    def accepts(self, value: Any) -> bool:
        # JSON kinds, not Python equality: 0 must not pass for false (numbers compare as numbers).
        return value is None or any(_kind(value) is _kind(ok) and value == ok for ok in self.no_ops)

    def allowed(self) -> str:
        values = ["null", *(msgspec.json.encode(v).decode() for v in self.no_ops)]
        return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"

    def describe(self) -> str:
        return f"Not supported yet ({self.why}): any value but {self.allowed()} is refused with 400."

    def refusal(self, param: str) -> APIError:
        return APIError(f"{param} is not supported yet ({self.why}); leave it out or send {self.allowed()}.",
                        400, param=param)
