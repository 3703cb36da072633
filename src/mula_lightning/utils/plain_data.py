"""Checkpoint metadata as plain data: normalised when it is saved, proven readable before the save completes.

Why: checkpoints are read with ``weights_only=True`` (:mod:`mula_lightning.utils.safe_load`: a checkpoint is data,
not code), but they are written with ``torch.save`` of whatever the Trainer collected: hyper-parameters, callback
states, loops, schedulers. A value the safe reader refuses (a config dataclass such as ``MulaConfig`` passed as a
typed constructor argument, a ``Path``, a NumPy scalar, an enum, a date) used to be written without complaint and
refused at the first resume, which under ``mula launch`` is the first relaunch after a failure: every restart died.

So every metadata blob is normalised at save (:func:`to_plain_data`) and round-tripped through the safe reader at
save time (:func:`check_plain_data`): what cannot be made plain fails the save that writes it, with the key named,
never the resume. The normalisation keeps the meaning of the values:

=======================================  ======================================================
value                                    stored as
=======================================  ======================================================
dataclass instance (``MulaConfig``)      ``dict`` of its fields (each normalised)
``pathlib`` path                         ``str``
NumPy scalar / array                     Python number / ``torch.Tensor``
``enum.Enum`` member                     its ``value`` (normalised)
``datetime`` / ``date`` / ``time``       ISO 8601 ``str``
``argparse`` / jsonargparse namespace    ``dict``
other ``Mapping`` (``AttributeDict``)    ``dict`` (keys normalised too)
``frozenset`` / ``range`` / ``slice``    ``set`` / ``list`` / ``(start, stop, step)``
namedtuple                               ``tuple``
=======================================  ======================================================

Tensors, dtypes, devices, sizes, numbers, strings, bytes and the containers ``dict``, ``OrderedDict``, ``list``,
``tuple``, ``set`` pass unchanged. A ``MulaConfig`` stored as a dict is rebuilt by ``MulaConfig(**d)`` (and by
``mula export``, which accepts either).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import io
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["UnloadableCheckpointValue", "check_plain_data", "roundtrips", "to_plain_data"]

_BUILTINS = (bool, int, float, complex, str, bytes, bytearray)
_TORCH = (torch.Tensor, torch.dtype, torch.device, torch.Size)


def _is_atom(value: Any) -> bool:
    """Exactly a builtin scalar (``np.float64`` subclasses ``float`` but pickles as NumPy) or a torch value."""
    return value is None or type(value) in _BUILTINS or isinstance(value, _TORCH)


class UnloadableCheckpointValue(ValueError):
    """A checkpoint value the safe reader would refuse; raised at save time, naming the key and the type."""

    def __init__(self, key: str, value: Any, source: str = "") -> None:
        self.key = key
        where = f"{source}: " if source else ""
        super().__init__(
            f"{where}checkpoint entry {key!r} holds a {type(value).__module__}.{type(value).__qualname__}, which "
            "the safe checkpoint reader (weights_only=True) refuses; store plain data there (numbers, strings, "
            "lists, dicts, tensors), e.g. the object's state_dict() or a dict of its fields. Nothing was saved "
            "for this step; the previous checkpoint is intact"
        )


def to_plain_data(value: Any) -> Any:
    """``value`` with every container walked and the types of the module docstring's table made plain.

    Values of other types are returned unchanged (:func:`check_plain_data` names them if the reader refuses them).
    """
    if _is_atom(value):
        return value
    if isinstance(value, enum.Enum):
        return to_plain_data(value.value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    numpy = _numpy()
    if numpy is not None:
        if isinstance(value, numpy.generic):
            return value.item()
        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(numpy.array(value, copy=True))
    for base in _BUILTINS:  # other subclasses of the builtins: their class is code
        if isinstance(value, base):
            return base(value)
    if isinstance(value, argparse.Namespace):
        return to_plain_data(vars(value))
    if type(value).__name__ == "Namespace" and hasattr(value, "as_dict"):  # jsonargparse
        return to_plain_data(value.as_dict())
    if isinstance(value, collections.OrderedDict) and type(value) is collections.OrderedDict:
        return collections.OrderedDict((to_plain_data(k), to_plain_data(v)) for k, v in value.items())
    if isinstance(value, Mapping):
        return {to_plain_data(k): to_plain_data(v) for k, v in value.items()}
    if isinstance(value, tuple):  # namedtuples included: their class is code
        return tuple(to_plain_data(v) for v in value)
    if isinstance(value, list):
        return [to_plain_data(v) for v in value]
    if isinstance(value, set | frozenset):
        return {to_plain_data(v) for v in value}
    if isinstance(value, range):
        return list(value)
    if isinstance(value, slice):
        return (to_plain_data(value.start), to_plain_data(value.stop), to_plain_data(value.step))
    return value


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return None
    return numpy


def roundtrips(value: Any) -> bool:
    """Whether ``value`` reads back through ``torch.load(weights_only=True)`` after ``torch.save``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal (UnpicklingError, a missing global) means "not plain"
        return False
    return True


def _first_refused(value: Any, key: str) -> tuple[str, Any] | None:
    """The first (key path, value) inside ``value`` that does not round-trip; None when all of it does."""
    if _is_atom(value):
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _first_refused(k, f"{key}[key {k!r}]") or _first_refused(v, f"{key}.{k}" if key else str(k))
            if found:
                return found
        return None if roundtrips(type(value)()) else (key, value)
    if isinstance(value, list | tuple | set):
        for i, v in enumerate(value):
            found = _first_refused(v, f"{key}[{i}]")
            if found:
                return found
        return None if type(value) in (list, tuple, set) else (key, value)
    return None if roundtrips(value) else (key or "<root>", value)


def check_plain_data(value: Any, source: str = "", skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`UnloadableCheckpointValue` naming the first entry of ``value`` the safe reader would refuse.

    Walks the containers (tensors and other atoms are not serialised: the walk costs nothing per tensor), so it is
    cheap on a whole Trainer checkpoint; ``skip`` names top-level keys not to walk (``state_dict``).
    """
    items = {k: v for k, v in value.items() if k not in skip} if isinstance(value, Mapping) else value
    found = _first_refused(items, "")
    if found is not None:
        raise UnloadableCheckpointValue(found[0], found[1], source)
