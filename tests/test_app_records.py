"""The app's record storage (`labml_zero/app/records.py`): records round-trip
through tagged JSON, what JSON cannot hold is a `TypeError` naming it, and a file
that is not such a record, a pickle included, is an error naming the file, never
unpickled.
"""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from labml_zero.app.records import RecordError, decode, encode, record_classes


class CreatesAFile:
    """Unpickling this opens `path` for writing: a stand-in for any code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_records_round_trip_through_json():
    from labml_db import Key

    record = {
        "step": np.arange(5, dtype=np.float64),
        "value": np.array([[1.5, np.nan], [np.inf, -2.0]], dtype=np.float32),
        "mean": np.float32(0.25),
        "count": np.int64(7),
        "run_uuids": {"a", "b"},
        "pair": (1, "x"),
        "by_rank": {0: "uuid", 1: "uuid_1"},
        "looks_like_a_tag": {"__set__": [1]},
        "key": Key("Run:abc"),
        "raw": b"\x00\xff",
        "nested": [{"k": None, "b": True}],
    }
    serializer, _, _ = record_classes()
    text = serializer().to_string(record)
    back = serializer().from_string(text)
    json.loads(text)  # the file is plain JSON
    assert set(back) == set(record)
    for name in ("step", "value"):
        assert back[name].dtype == record[name].dtype
        assert back[name].shape == record[name].shape
        np.testing.assert_array_equal(back[name], record[name])
        assert back[name].flags.writeable
    assert type(back["mean"]) is np.float32 and back["mean"] == np.float32(0.25)
    assert type(back["count"]) is np.int64 and back["count"] == 7
    assert back["run_uuids"] == {"a", "b"} and back["pair"] == (1, "x")
    assert back["by_rank"] == {0: "uuid", 1: "uuid_1"}
    assert back["looks_like_a_tag"] == {"__set__": [1]}
    assert isinstance(back["key"], Key) and str(back["key"]) == "Run:abc"
    assert back["raw"] == b"\x00\xff" and back["nested"] == record["nested"]


def test_storage_refuses_what_json_cannot_hold():
    with pytest.raises(TypeError, match="cannot store a numpy array of dtype object"):
        encode({"x": np.array([object()])})
    with pytest.raises(TypeError, match="cannot store a CreatesAFile as JSON"):
        encode({"x": CreatesAFile(Path("never"))})
    with pytest.raises(ValueError, match="refusing a stored array of dtype object"):
        decode({"__ndarray__": ["|O", [1], "AAAAAAAAAAA="]})


def test_a_record_that_is_not_json_is_an_error_naming_its_file(tmp_path):
    serializer, driver, _ = record_classes()

    class Run:
        """The driver needs only the model's name."""

    records = driver(serializer(), Run, tmp_path / "Run")
    (tmp_path / "Run" / "Run:bad.json").write_bytes(
        pickle.dumps(CreatesAFile(tmp_path / "ran")))
    with pytest.raises(RecordError, match=r"Run:bad\.json is not a record"):
        records.load_dict("Run:bad")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("text, why", [
    ("[]", "a list, not an object of fields"),
    ('"Run"', "a str, not an object of fields"),
    ('{"__dict__": [[1, "x"]]}', "a field name is not a string"),
])
def test_a_record_that_is_not_an_object_of_fields_is_an_error_naming_its_file(
        tmp_path, text, why):
    """JSON, but not a record: `labml_db` would fail on it with a `TypeError`
    that names neither the file nor the fault."""
    serializer, driver, _ = record_classes()

    class Run:
        """The driver needs only the model's name."""

    records = driver(serializer(), Run, tmp_path / "Run")
    (tmp_path / "Run" / "Run:bad.json").write_text(text)
    with pytest.raises(RecordError, match=rf"Run:bad\.json is not a record this "
                                          rf"app wrote: {why}"):
        records.load_dict("Run:bad")


def test_a_record_that_cannot_be_encoded_leaves_its_file_as_it_was(tmp_path):
    serializer, driver, _ = record_classes()

    class Run:
        """The driver needs only the model's name."""

    records = driver(serializer(), Run, tmp_path / "Run")
    records.save_dict("Run:a", {"step": np.arange(3), "name": "first"})
    before = (tmp_path / "Run" / "Run:a.json").read_text()
    with pytest.raises(TypeError, match="cannot store a CreatesAFile as JSON"):
        records.save_dict("Run:a", {"name": CreatesAFile(tmp_path / "never")})
    assert (tmp_path / "Run" / "Run:a.json").read_text() == before
    back = records.load_dict("Run:a")
    assert back["name"] == "first"
    np.testing.assert_array_equal(back["step"], np.arange(3))


def test_a_write_that_fails_leaves_the_record_and_index_as_they_were(tmp_path,
                                                                    monkeypatch):
    """A full disk (or a kill) in the middle of a write: the record and the
    index keep what they held, and no temporary file is left (they used to be
    emptied first, and then no run loaded)."""
    serializer, driver, index_driver = record_classes()
    from labml_db.serializer.json import JsonSerializer

    class Run:
        """The drivers need only the class's name."""

    records = driver(serializer(), Run, tmp_path / "Run")
    records.save_dict("Run:a", {"name": "first"})
    index = index_driver(JsonSerializer(), Run, tmp_path / "indexes" / "Run.json")
    index.set("a", "Run:a")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.json")}

    def full(self, text, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match="No space left"):
        records.save_dict("Run:a", {"name": "second"})
    with pytest.raises(OSError, match="No space left"):
        index.set("b", "Run:b")
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*")
            if p.is_file()} == before
    assert records.load_dict("Run:a")["name"] == "first"
