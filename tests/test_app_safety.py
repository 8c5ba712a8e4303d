"""The labml app under bad input (`labml_zero/app/server.py`): the request guard, the
request-size limit and the loopback-only default; its JSON record storage is in
`test_app_records.py`.

Most cases run in process: `RequestGuard` around a small ASGI app. One app server
on a free port checks the same things end to end: a crafted pickle in its data
directory never runs, malformed requests get a 4xx and one log line without a
traceback, a 100 MB body is refused with 413 while the server's memory stays
flat, and a damaged record leaves its run out of the runs list, which lists the
others.
"""

import asyncio
import http.client
import json
import pickle
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from labml_zero.app import server as app_module
from labml_zero.app.client import app_url_if_running
from labml_zero.app.records import RecordError
from labml_zero.app.server import AppConfig, RequestGuard, main, serve
from tests.test_app import free_port, subprocess_env
from tests.test_app_records import CreatesAFile

MiB = 2**20
RUN_UUID = "00112233445566778899aabbccddeeff"


# ---------------------------------------------------------------- the guard


async def echo(scope, receive, send):
    """An ASGI app that answers with the body it was given."""
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


def call(guard, path="/api/v1/x", *, chunks=(b"",), headers=(), method="POST"):
    """Run one request through `guard`; `(status, body, chunks it read)`."""
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    pending = list(chunks)
    read, sent = [], []

    async def receive():
        chunk = pending.pop(0)
        read.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], body, len(read)


def test_the_guard_passes_a_good_body_through_whole():
    guard = RequestGuard(echo, max_body=100)
    assert call(guard, chunks=(b'{"a":', b" [1, 2]}")) == (200, b'{"a": [1, 2]}', 2)


def test_a_declared_body_over_the_limit_is_413_before_any_of_it_is_read():
    guard = RequestGuard(echo, max_body=100)
    status, body, read = call(guard, headers=[("content-length", "101")],
                              chunks=(b"x" * 101,))
    assert (status, read) == (413, 0)
    assert json.loads(body) == {"error": "the body is over 100 bytes"}


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    guard = RequestGuard(echo, max_body=100)
    status, _, read = call(guard, chunks=[b"x" * 60] * 10)
    assert (status, read) == (413, 2)


@pytest.mark.parametrize("path, body, message", [
    ("/api/v1/runs", b"{bad", "the body is not JSON"),
    ("/api/v1/default/track", b"[1, 2]", "a JSON object or a list of objects"),
    ("/api/v1/default/computer", b'"text"', "a JSON object or a list of objects"),
    ("/vendor/a\x00b", b"", "NUL or control character"),
])
def test_malformed_requests_are_400_with_a_short_message(path, body, message):
    status, reply, _ = call(RequestGuard(echo, max_body=100), path, chunks=(body,))
    assert status == 400 and message in json.loads(reply)["error"]


def test_json_nested_past_the_parser_is_400_and_one_log_line(capsys):
    status, body, _ = call(RequestGuard(echo, max_body=MiB), chunks=(b"[" * 100_000,))
    assert status == 400 and b"nested too deeply" in body
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "400 the body's JSON is nested too deeply" in err


def test_a_data_dir_that_cannot_be_written_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data-dir", "/proc/self/labml-app"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--data-dir /proc/self/labml-app is not writable" in err


def test_a_missing_dependency_prints_the_install_hint(monkeypatch, tmp_path):
    def serve_without_uvicorn(config):
        raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")

    monkeypatch.setattr(app_module, "serve", serve_without_uvicorn)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data-dir", str(tmp_path / "data")])
    message = str(exit_info.value.code)
    assert "no module named 'uvicorn'" in message and "bash setup.sh" in message


def test_a_bad_content_length_is_400():
    status, reply, _ = call(RequestGuard(echo, max_body=100),
                            headers=[("content-length", "-5")])
    assert status == 400 and "Content-Length" in json.loads(reply)["error"]


@pytest.mark.parametrize("error, status", [
    (KeyError("run_uuids"), 400), (TypeError("not a list"), 400),
    (RecordError("Run:x.json is not a record"), 500), (RuntimeError("bug"), 500),
])
def test_a_failing_handler_is_one_line_not_a_traceback(error, status, capsys):
    async def failing(scope, receive, send):
        raise error

    got, reply, _ = call(RequestGuard(failing, max_body=100), chunks=(b"{}",))
    assert got == status and type(error).__name__ in json.loads(reply)["error"]
    log = capsys.readouterr().err
    assert log.count("\n") == 1 and "Traceback" not in log
    assert log.startswith("labml app: POST /api/v1/x: ")
    assert "test_app_safety.py:" in log


# ---------------------------------------------------------------- flags


def test_a_remote_host_needs_allow_remote(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--host", "0.0.0.0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "host 0.0.0.0 can be reached from other machines" in err
    assert "--allow-remote" in err
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert AppConfig(host=host).host == host
    for host in ("0.0.0.0", "::", "192.168.1.5", "myhost"):
        with pytest.raises(ValueError, match="--allow-remote"):
            AppConfig(host=host)


def test_serving_a_remote_host_warns_there_is_no_authentication(monkeypatch,
                                                                capsys, tmp_path):
    import uvicorn

    served = []
    monkeypatch.setattr(app_module, "create_app", lambda config: "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    serve(AppConfig(host="0.0.0.0", allow_remote=True, data_dir=tmp_path))
    assert served == [{"host": "0.0.0.0", "port": 5005, "log_level": "warning"}]
    err = capsys.readouterr().err
    assert "WARNING: 0.0.0.0:5005 can be reached from other machines" in err
    assert "no authentication" in err
    serve(AppConfig(data_dir=tmp_path))
    assert "WARNING" not in capsys.readouterr().err


def test_the_size_limit_flag(monkeypatch, capsys, tmp_path):
    configs = []
    monkeypatch.setattr(app_module, "serve", configs.append)
    main(["--data-dir", str(tmp_path)])
    main(["--data-dir", str(tmp_path), "--max-request-mib", "0.5"])
    assert [c.max_request_bytes for c in configs] == [16 * MiB, MiB // 2]
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit) as e:
            main(["--max-request-mib", bad])
        assert e.value.code == 2
        assert "--max-request-mib must be in" in capsys.readouterr().err


# ---------------------------------------------------------------- one server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("app")
    config = AppConfig(port=free_port(), data_dir=tmp / "data")
    log_path = tmp / "app.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.app", "--port", str(config.port),
         "--data-dir", str(config.data_dir)],
        cwd=tmp, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while app_url_if_running(config.api_url, timeout_s=1.0) is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "app did not answer within 60 s"
            time.sleep(0.2)
        yield config, proc, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def request(config, path, body: bytes | None = None, method=None):
    """`(status, body)` of one request; 4xx/5xx are answers, not errors."""
    req = urllib.request.Request(config.web_url + path.lstrip("/"), data=body,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def track(config, body) -> dict:
    status, reply = request(config, f"api/v1/default/track?run_uuid={RUN_UUID}"
                                    f"&labml_version=0.5.3", json.dumps(body).encode())
    assert status == 200, reply
    return json.loads(reply)


def test_a_crafted_pickle_in_the_data_directory_never_runs(server, tmp_path):
    config, _, _ = server
    track(config, [{"name": "safe", "time": time.time()}])
    models = config.data_dir / "models"
    records = sorted(models.glob("*/*.json"))
    assert {p.parent.name for p in records} >= {"Run", "Project", "User", "Status"}
    marker = tmp_path / "code ran"
    payload = pickle.dumps(CreatesAFile(marker))
    # The payload works: the pickle storage labml-app pairs with runs it.
    from labml_db.serializer.pickle import PickleSerializer
    PickleSerializer().from_string(payload)
    assert marker.is_file()
    marker.unlink()
    # Beside every record, where the pickle storage would read it.
    for record in records:
        record.with_suffix(".pkl").write_bytes(payload)
    for path in ("api/v1/runs/null", f"api/v1/run/{RUN_UUID}", "runs"):
        assert request(config, path)[0] == 200, path
    assert RUN_UUID in request(config, "api/v1/runs/null")[1].decode()

    # A fresh app on the same directory counts them and reads none.
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "labml_zero.app", "--port", str(port),
         "--data-dir", str(config.data_dir)], env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/api/v1/default/"
        deadline = time.monotonic() + 60
        while app_url_if_running(url, timeout_s=1.0) is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/runs/null",
                                    timeout=30) as response:
            assert RUN_UUID in response.read().decode()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert f"ignoring {len(records)} pickle records (*.pkl)" in out, out
    assert not marker.exists()


MALFORMED = [
    ("POST", f"api/v1/default/track?run_uuid={RUN_UUID}&labml_version=0.5.3",
     b"{not json", 400),
    ("POST", f"api/v1/default/track?run_uuid={RUN_UUID}&labml_version=0.5.3",
     b"[1, 2, 3]", 400),
    ("POST", f"api/v1/default/track?run_uuid={RUN_UUID}&labml_version=0.5.3"
     f"&rank=abc", b"[]", 400),
    ("POST", f"api/v1/metrics/{RUN_UUID}", b'{"no get_all": 1}', 400),
    ("POST", f"api/v1/metrics/{RUN_UUID}", b'"a string"', 400),
    ("PUT", "api/v1/runs", b'{"x": 1}', 400),
    ("PUT", "api/v1/runs", b"\xff\xfe", 400),
    ("POST", f"api/v1/metrics/{RUN_UUID}", b"[" * 100_000, 400),
    ("GET", "vendor/%00", None, 400),
    ("GET", "vendor/..%2f..%2fapp.py", None, 404),
    ("GET", "vendor/%2e%2e/%2e%2e/files.py", None, 404),
    ("GET", "vendor/css/..%2f..%2f..%2f..%2f..%2fetc%2fpasswd", None, 404),
]


@pytest.mark.parametrize("method, path, body, status", MALFORMED)
def test_malformed_requests_get_a_4xx_and_no_traceback(server, method, path, body,
                                                       status):
    config, _, log_path = server
    got, reply = request(config, path, body, method)
    assert got == status, reply
    assert len(reply) < 300 and b"Traceback" not in reply
    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]


def test_traversal_outside_the_page_serves_only_the_page(server):
    config, _, _ = server
    source = Path(app_module.__file__).read_text()
    for path in ("..%2f..%2fetc%2fpasswd", "js/..%2f..%2f..%2fapp.py",
                 "%2e%2e/%2e%2e/%2e%2e/etc/passwd", "static/../../app.py"):
        status, body = request(config, path)
        assert status in (200, 404), path
        assert b"root:" not in body and source.encode()[:200] not in body, path


def rss(pid: int) -> dict[str, int]:
    """`VmRSS` (now) and `VmHWM` (the peak) of a process, in bytes."""
    fields = dict(re.findall(r"(Vm\w+):\s+(\d+) kB",
                             Path(f"/proc/{pid}/status").read_text()))
    return {k: int(fields[k]) * 1024 for k in ("VmRSS", "VmHWM")}


def send_until_answered(config, head: bytes, chunk: bytes, total: int):
    """Send `head`, then `chunk`s up to `total` bytes, until the server answers."""
    sent = 0
    with socket.create_connection(("127.0.0.1", config.port), timeout=30) as s:
        s.sendall(head)
        while sent < total and not select.select([s], [], [], 0)[0]:
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        s.settimeout(30)
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, response.read(), sent


@pytest.mark.parametrize("chunked", [False, True])
def test_a_100_mb_body_is_refused_with_413_and_memory_stays_flat(server, chunked,
                                                                 capsys):
    config, proc, _ = server
    total = 100 * 10**6
    path = f"/api/v1/default/track?run_uuid={RUN_UUID}&labml_version=0.5.3"
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\n{length}\r\n\r\n").encode()
    block = b" " * MiB
    chunk = b"%x\r\n%s\r\n" % (len(block), block) if chunked else block
    before = rss(proc.pid)
    status, reply, sent = send_until_answered(config, head, chunk, total)
    after = rss(proc.pid)
    assert status == 413, reply
    assert json.loads(reply) == {"error": f"the body is over {16 * MiB} bytes"}
    # The server stopped the upload long before its end.
    assert sent < total // 2
    grew = after["VmHWM"] - before["VmRSS"]
    with capsys.disabled():
        print(f"\n413 {'chunked' if chunked else 'declared'}: sent {sent / MiB:.0f}"
              f" MiB of {total / MiB:.0f}; server RSS {before['VmRSS'] / MiB:.0f} ->"
              f" {after['VmRSS'] / MiB:.0f} MiB, peak {after['VmHWM'] / MiB:.0f} MiB")
    # At most the limit's buffer and a copy, never the 95 MiB body.
    assert grew < 3 * 16 * MiB, (before, after)


# ---------------------------------------------------------------- damaged records


def record_of(config, run_uuid: str) -> Path:
    """The file of a run's `Run` record (its key is not its uuid)."""
    found = [p for p in (config.data_dir / "models" / "Run").glob("*.json")
             if f'"run_uuid": "{run_uuid}"' in p.read_text()]
    assert len(found) == 1, found
    return found[0]


def status_record_of(config, run_uuid: str) -> Path:
    """The file of a run's `Status` record, which the runs list reads too."""
    key = json.loads(record_of(config, run_uuid).read_text())["status"]["__key__"]
    return config.data_dir / "models" / "Status" / f"{key}.json"


def ended_run(config, run_uuid: str, name: str) -> None:
    """A run of one request, with its status: the app answers it at once."""
    now = time.time()
    body = [{"name": name, "time": now,
             "status": {"rank": 0, "status": "completed", "details": None,
                        "time": now}}]
    status, reply = request(config, f"api/v1/default/track?run_uuid={run_uuid}"
                                    f"&labml_version=0.5.3", json.dumps(body).encode())
    assert status == 200, reply


# How a record can be damaged: cut short (a full disk, a kill while another
# tool wrote it), not an object, or an object with a field of the wrong type.
DAMAGES = {
    "Run cut short": (record_of, lambda text: text[:len(text) // 2]),
    "Run a list": (record_of, lambda text: "[]"),
    "Run start_time a string": (record_of, lambda text: json.dumps(
        {**json.loads(text), "start_time": "yesterday"})),
    "Status cut short": (status_record_of, lambda text: text[:len(text) // 2]),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_record_leaves_its_run_out_of_the_list(server, damage):
    """One run's damaged record used to fail the whole list (500, or 400 for
    a field of the wrong type): the page listed no run at all."""
    config, _, log_path = server
    good, bad = uuid.uuid4().hex, uuid.uuid4().hex
    for run_uuid in (good, bad):
        ended_run(config, run_uuid, damage)
    which, damaged = DAMAGES[damage]
    record = which(config, bad)
    kept = record.read_text()
    logged = len(log_path.read_text())
    record.write_text(damaged(kept))
    try:
        status, reply = request(config, "api/v1/runs/null")
        log = log_path.read_text()[logged:]
    finally:
        record.write_text(kept)
    # the others are listed, the damaged run is not, and one line says which
    assert status == 200, reply
    listed = [r["run_uuid"] for r in json.loads(reply)["runs"]]
    assert good in listed and bad not in listed
    assert log.count("\n") == 1 and "Traceback" not in log, log
    assert log.startswith(f"labml app: the runs list leaves out run {bad}: "), log
    if damage != "Run start_time a string":
        assert f"{record.name} is not a record this app wrote" in log, log


@pytest.mark.parametrize("damage, path", [
    ("Run cut short", "api/v1/run/{uuid}"), ("Run a list", "api/v1/run/{uuid}"),
    ("Status cut short", "api/v1/run/status/{uuid}")])
def test_a_damaged_record_is_a_500_naming_its_file(server, damage, path):
    """The damaged run's own page asks for the record: a short error that names
    the file, not a traceback, nor a 400 that blames the request."""
    config, _, log_path = server
    bad = uuid.uuid4().hex
    ended_run(config, bad, damage)
    which, damaged = DAMAGES[damage]
    record = which(config, bad)
    kept = record.read_text()
    record.write_text(damaged(kept))
    logged = len(log_path.read_text())
    try:
        status, reply = request(config, path.format(uuid=bad))
    finally:
        record.write_text(kept)
    assert status == 500, reply
    error = json.loads(reply)["error"]
    assert error.startswith("the app failed: RecordError: ") and \
        f"{record.name} is not a record this app wrote" in error, error
    log = log_path.read_text()[logged:]
    assert log.count("\n") == 1 and "Traceback" not in log, log
