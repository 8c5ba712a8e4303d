"""
---
title: The app's records, as JSON
summary: How the offline labml app stores labml-app's records - tagged JSON that
  decodes only to data, through labml_db's file driver - and why it never unpickles.
---

# The app's records, as JSON

labml-app keeps what a run sends (its status, configs, each tracked series) and its
own bookkeeping (projects, users, folders) as `labml_db` *models*: dicts of plain
values with a key such as `Run:<uuid>`. `labml_db` turns a model into text with a
*serializer* and stores the text with a *driver*. This page is what
[the offline app](server.html) plugs in: a serializer that writes JSON, the
file driver, and their registration. No record is ever unpickled (see Note:
records are JSON).
"""

import base64
import json
import os
import secrets
from pathlib import Path

import numpy as np

__all__ = ["RecordError", "encode", "decode", "record_classes", "init_file_db",
           "ignored_pickles"]

# ## Note: records are JSON
#
# labml-app pickles its records, and unpickling runs whatever the file names: a
# record someone else placed in the data directory would run their code here as
# soon as a page listed runs. We store records as JSON, which decodes only to data,
# and never unpickle anything. `*.pkl` files left by the earlier pickle storage are
# counted, so the app can say it ignores them, and never opened.
#
# `labml_db`'s own JSON serializer cannot hold the numpy arrays (a series' steps and
# values) and sets (a folder's runs) in labml-app's records, so `encode` writes
# those, and the few other types labml-app keeps, as *tagged* objects: a dict with
# one key, the tag, that names the type. `decode` builds only the six types the
# tags name, and an array only of a numeric dtype; anything else in a file decodes
# to dicts, lists, strings, numbers, booleans and `None`.
#
# The one-key objects that stand for what JSON has no type for.
TAGS = ("__ndarray__", "__set__", "__tuple__", "__bytes__", "__key__", "__dict__")
# bool, signed and unsigned integers, floats, complex: bytes that are only numbers.
ARRAY_KINDS = "biufc"


def encode(value):
    """
    ## A record's value as JSON-ready data

    JSON's own types pass through; each other type labml-app keeps becomes a
    tagged object (see Note: records are JSON); a type it does not know fails
    on its first write:

    * `{"__ndarray__": [dtype, shape, base64]}`, an array or numpy scalar (a 0-d
      array), of a numeric dtype only: an `object` array's bytes are pointers;
    * `{"__set__": [...]}` and `{"__tuple__": [...]}`;
    * `{"__bytes__": base64}`;
    * `{"__key__": "Run:..."}`, a `labml_db` key in `labml_db`'s own string form;
    * `{"__dict__": [[k, v], ...]}`, a dict with a key that is not a string (a
      run's ranks, `{0: uuid, 1: uuid_1}`), or whose one key is a tag, so that
      it does not decode as the tag.

    Any other type is a `TypeError` naming it, before the record's file is
    opened.
    """
    from labml_db import Key

    # `np.float64` is a `float`; it goes on to be a 0-d array, so that it comes
    # back as an `np.float64`.
    if value is None or isinstance(value, (bool, int, float, str)) \
            and not isinstance(value, np.generic):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind not in ARRAY_KINDS:
            raise TypeError(f"cannot store a numpy array of dtype {array.dtype}")
        data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()
        return {"__ndarray__": [array.dtype.str, list(array.shape), data]}
    if isinstance(value, Key):
        return {"__key__": str(value)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, (set, frozenset, tuple)):
        tag = "__tuple__" if isinstance(value, tuple) else "__set__"
        return {tag: [encode(v) for v in value]}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        plain = all(isinstance(k, str) for k in value) \
            and not (len(value) == 1 and next(iter(value)) in TAGS)
        if plain:
            return {k: encode(v) for k, v in value.items()}
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    # A labml-app version that keeps another type in a record (a `datetime`, say)
    # fails on that record's first write with this `TypeError` naming the type;
    # the file keeps what it held before (see `RecordDriver.save_dict`).
    raise TypeError(f"cannot store a {type(value).__name__} as JSON")


def decode(value):
    """
    ## The inverse of `encode`

    A malformed tag (a body of the wrong shape, an unknown or non-numeric dtype)
    is a `ValueError` or `TypeError`, which the driver reports as a `RecordError`.
    """
    from labml_db import Key

    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in TAGS:
        return {k: decode(v) for k, v in value.items()}
    (tag, body), = value.items()
    if tag == "__ndarray__":
        dtype, shape, data = body
        dtype = np.dtype(dtype)
        # Checked again on the way in: the file may not be one `encode` wrote.
        if dtype.kind not in ARRAY_KINDS:
            raise ValueError(f"refusing a stored array of dtype {dtype}")
        array = np.frombuffer(base64.b64decode(data), dtype=dtype).reshape(shape)
        # 0-d arrays were numpy scalars; `.copy()` makes the array writable.
        return array[()] if array.ndim == 0 else array.copy()
    if tag == "__key__":
        # `Key` only holds the string; nothing is loaded until a handler asks.
        return Key(body)
    if tag == "__bytes__":
        return base64.b64decode(body)
    items = [decode(v) for v in body]
    return {"__set__": set, "__tuple__": tuple, "__dict__": dict}[tag](items)


class RecordError(RuntimeError):
    """
    ## A stored record that this app could not have written

    A `RuntimeError`, not a `ValueError`, so that the app's guard answers it
    with a `500` (see Note: every request passes one guard): the fault is in
    the data directory, not in the request. The runs list leaves out the run
    whose record it is, and lists the others (see Note: a damaged record
    costs only its run).
    """


def record_classes():
    """
    ## `labml_db`'s serializer and file driver, with our JSON in them

    Defined inside a function because `labml_db` belongs to the `app` extra,
    which the core install does not have. Returns the three classes,
    `(RecordSerializer, RecordDriver, IndexDriver)`; `init_file_db` makes one
    driver per model and per index.
    """
    from labml_db.driver.file import FileDbDriver
    from labml_db.index_driver.file import FileIndexDbDriver
    from labml_db.serializer import Serializer

    class RecordSerializer(Serializer):
        """One record as one JSON file (see Note: records are JSON)."""
        file_extension = "json"
        is_bytes = False

        def to_string(self, data: dict) -> str:
            return json.dumps(encode(data))

        def from_string(self, data: str | None) -> dict | None:
            return None if data is None else decode(json.loads(data))

    class RecordDriver(FileDbDriver):
        """
        `labml_db`'s file driver: a bad file is a `RecordError` naming it, and a
        record that cannot be encoded leaves its file as it was.
        """

        def __init__(self, serializer, model_cls, db_path: Path):
            super().__init__(serializer, model_cls, db_path)
            self.directory = db_path

        def load_dict(self, key: str) -> dict | None:
            try:
                data = super().load_dict(key)
            except (ValueError, TypeError) as e:
                raise RecordError(f"{self.directory / key}.json is not a record "
                                  f"this app wrote: {e}") from None
            # `labml_db` makes the model with `Model(key, **data)`: anything but
            # an object of named fields would fail there, as a `TypeError` that
            # names neither the file nor the fault and reads as the request's
            if data is not None and not isinstance(data, dict):
                raise RecordError(f"{self.directory / key}.json is not a record "
                                  f"this app wrote: a {type(data).__name__}, not "
                                  f"an object of fields")
            if data is not None and not all(isinstance(k, str) for k in data):
                raise RecordError(f"{self.directory / key}.json is not a record "
                                  f"this app wrote: a field name is not a string")
            return data

        def save_dict(self, key: str, data: dict) -> int:
            # `FileDbDriver.save_dict` opens the file, which empties it, before it
            # encodes: a record that `encode` refuses, a full disk or a kill
            # between the two would leave a file that no longer loads. Encoded
            # first, then written beside it and renamed over it.
            text = self._serializer.to_string(data)
            replace_text(self.directory / f"{key}.json", text)
            return len(text)

    class IndexDriver(FileIndexDbDriver):
        """`labml_db`'s file index driver, its file replaced whole on each
        change (it too emptied the file before writing it)."""

        def _save_cache(self):
            replace_text(self._index_path, self._serializer.to_string(self._cache))

    return RecordSerializer, RecordDriver, IndexDriver


def replace_text(path: Path, text: str) -> None:
    """
    `path` holds `text`, or what it held before: written to a hidden sibling,
    then renamed over it, which readers see whole. Not flushed to the disk:
    the app writes a record on every tracked step, and a record lost to a power
    cut costs the app's copy of a few steps, not the run's own log.
    """
    # hidden, and unique to this write (the app sits above the package's
    # file helpers, so it names its own)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def init_file_db(data_dir: Path) -> None:
    """
    ## Register the file drivers for every labml-app model and index

    `labml_db`'s file driver, with clearer errors: one file per record under
    `models/<Model>/` and one JSON file per index under `indexes/`. The same
    model and index lists as labml-app's `init_mongo_db`; records are
    JSON (see Note: records are JSON), and so are the indexes, as in `labml_db`.
    One writer: the file drivers keep each index in memory and rewrite its file
    on every change, which is only safe with a single process on a data
    directory. A data directory written by the earlier pickle storage is not
    read.
    """
    from labml_app import db
    from labml_db import Index, Model
    from labml_db.serializer.json import JsonSerializer

    serializer, driver, index_driver = record_classes()
    # `db.models` and `db.indexes` include the analyses' (series, logs, ...).
    Model.set_db_drivers([driver(serializer(), m, data_dir / "models" / m.__name__)
                          for m in db.models])
    Index.set_db_drivers([index_driver(JsonSerializer(), i,
                                       data_dir / "indexes" / f"{i.__name__}.json")
                          for i in db.indexes])


def ignored_pickles(data_dir: Path) -> int:
    """
    How many `*.pkl` records an older version of this app left; never opened:
    unpickling them is what this storage exists to avoid.
    """
    return sum(1 for _ in (data_dir / "models").glob("*/*.pkl"))
