"""The config base of every layer: ``ConfigModel`` (a pydantic model that refuses unknown
keys and loose values) and ``config_error_message``, the one formatter of their errors,
which names the key with its whole path (``engine.max_num_seqs``)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import ClassVar, Iterable, get_args

from pydantic import BaseModel, ConfigDict, ValidationError


# set while a config model is being built: a section built inside another leaves the
# message to the outermost, which names the key with its whole path (engine.max_num_seqs)
_building: ContextVar[bool] = ContextVar("rayguide_config_building", default=False)


class ConfigModel(BaseModel):
    """The base of every layer's config: unknown keys are refused (extra="forbid"), values
    are strict (a YAML ``loop_guard: "yes"`` is an error, not True), and a failed build
    raises ValueError with config_error_message's text, keys prefixed with ``section``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    section: ClassVar[str | None] = None

    def __init__(self, **values):
        if _building.get():  # inside another config: its errors carry our path
            super().__init__(**values)
            return
        token = _building.set(True)
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ValueError(config_error_message(exc, self.section, type(self))) from None
        finally:
            _building.reset(token)

    def __setattr__(self, name, value):
        try:  # checked where the model says validate_assignment
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ValueError(config_error_message(exc, self.section, type(self))) from None


def config_error_message(exc: ValidationError, section: str | None,
                         known: Iterable[str] | type[BaseModel], most: int = 5) -> str:
    """The one "message naming the key" of every config (the runtime's sections, the
    grammar cache's, the engine's, the app's arguments): one part per problem (the first
    ``most``), each naming the key as ``section.key``: ``unknown key; known keys: a, b``
    for a key the model does not have, else pydantic's reason and the value given (cut
    short). ``known``: the model class (its nested models' keys are listed too) or the
    top level's key names."""
    parts = []
    for err in exc.errors()[:most]:
        key = ".".join(str(p) for p in (section, *err["loc"]) if p is not None) or "(config)"
        if err["type"] == "extra_forbidden":
            parts.append(unknown_key_message(key, _known_at(known, err["loc"][:-1])))
        else:
            reason = err["msg"].removeprefix("Value error, ")
            parts.append(f"{key}: {reason} (got {_short(err.get('input'))})")
    return "; ".join(parts)


def unknown_key_message(key: str, known: Iterable[str] | None) -> str:
    """``key: unknown key; known keys: a, b``: the words for a key nobody defined, shared
    by the configs and the places that check a plain dict (SamplingParams.from_dict)."""
    return f"{key}: unknown key" + (f"; known keys: {', '.join(sorted(known))}"
                                    if known is not None else "")


def _known_at(known, loc: tuple) -> list[str] | None:
    """The key names of the model at ``loc`` (a path of field names from ``known``), or
    None where it is not a model we can name (a list item, a dict)."""
    if not isinstance(known, type):
        return (list(known) or None) if not loc else None
    model = known
    for name in loc:
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            return None
        model = next((t for t in (field.annotation, *get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:
            return None
    return list(model.model_fields)


def _short(value, limit: int = 80) -> str:
    """A value as the message shows it: its repr, cut to ``limit`` characters (a request's
    prompt or a hot spec's schema may be long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
