"""
---
title: python -m labml_zero.app
summary: The labml app on this machine, offline - labml-app's API and page, with JSON
  files instead of MongoDB, its CDN scripts served from the package, and a guard that
  refuses malformed or oversized requests.
---

# `python -m labml_zero.app`: watch runs in the labml app, offline

```bash
pip install -e '.[app]'
python -m labml_zero.app --port 5005        # prints the page and the API URL
python -m labml_zero.finetune_neox --app-url http://127.0.0.1:5005/api/v1/default/
```

[labml-app](https://github.com/labmlai/labml/tree/master/app) is a FastAPI server
that receives what labml's client tracks (configs, status, the loss series) and a
single-page web app that charts it. Two things keep its own `labml app-server` from
working on an offline machine: it connects to MongoDB when it is imported, and its
page loads its scripts from CDNs. This app replaces those two (see `create_app`)
and keeps everything else labml-app's own.
"""

import argparse
import gzip
import ipaddress
import json
import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from labml_zero.app.records import ignored_pickles, init_file_db
from labml_zero.app.routes import runs_endpoint, track_endpoint

__all__ = ["AppConfig", "RequestGuard", "create_app", "serve", "main"]

# labml-app's `index.html` loads **d3, Bootstrap and Font Awesome from CDNs**;
# without them the page stays blank. The same files, of the versions its tags name
# (tested: tests/test_app.py::test_the_bundled_files_are_the_versions_the_page_loads),
# from their npm packages, ship in `labml_zero/app/assets/` (a few hundred
# kilobytes, versions and licenses in its `NOTICE`), and we serve an `index.html`
# whose three tags point at them.
ASSETS = Path(__file__).parent / "assets"

# index.html tag -> where the same file lives in assets (served under /vendor/).
CDN_ASSETS = {
    "bootstrap": ("link", "css/bootstrap.min.css"),
    "d3": ("script", "js/d3.v6.min.js"),
    "font-awesome": ("link", "css/fontawesome.min.css"),
}

MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".woff2": "font/woff2"}


@dataclass
class AppConfig:
    """
    ## Where the app listens and keeps its data
    """

    host: str = "127.0.0.1"
    """Address to bind; the loopback address keeps an unauthenticated app private."""
    port: int = 5005
    """TCP port; the default, {{py: app.AppConfig().port | d}}, is the one labml's own
    `labml app-server` listens on
    (tested: tests/test_app.py::test_the_default_port_is_labmls)."""
    data_dir: Path = field(
        default_factory=lambda: Path.home() / ".labml_zero" / "app")
    """Runs, series and indexes, as files; created if missing."""
    token: str = "default"
    """Project token in the API URL runs send to (see `init_projects`)."""
    allow_remote: bool = False
    """Serve a `host` other than loopback (see Note: no authentication)."""
    max_request_bytes: int = 16 * 2**20
    """$L$, the largest request body accepted (see Note: every request passes one
    guard); the default, {{py: app.AppConfig().max_request_bytes // 2**20}} MiB, is
    far above a `track` request, a few seconds of a run."""

    def __post_init__(self):
        if not self.host:
            raise ValueError("host must be a non-empty address, e.g. '127.0.0.1'")
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(f"host {self.host} can be reached from other machines "
                             f"and the app has no authentication; pass "
                             f"--allow-remote to serve it anyway")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, "
                             f"got {self.max_request_bytes}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.token):
            raise ValueError(f"token must be letters, digits, '_' or '-', "
                             f"got {self.token!r}")
        self.data_dir = Path(self.data_dir).expanduser()
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ValueError(f"data_dir is a file, not a directory: {self.data_dir}")

    @property
    def web_url(self) -> str:
        """The page to open in a browser."""
        return f"http://{self.host}:{self.port}/"

    @property
    def api_url(self) -> str:
        """What a run's `--app-url` (labml's `app_url`) should be."""
        return f"http://{self.host}:{self.port}/api/v1/{self.token}/"


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address; a host name is taken as remote."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def import_labml_app(config: AppConfig) -> None:
    """
    #### Import labml-app, which reads its settings from the environment

    `labml_app.settings` reads the server's address from two environment variables
    at import time, so they are set first.
    """
    os.environ["LABML_APP_SERVER_IP"] = config.host
    os.environ["LABML_APP_SERVER_PORT"] = str(config.port)
    try:
        # `db` before `handlers`: that is the order labml-app's own server imports
        # them in, and the other order is a circular import.
        from labml_app import db  # noqa: F401
    except ImportError as e:
        raise ImportError("labml-app is not installed; run bash setup.sh, or "
                          "install the app extra: pip install -e '.[app]'") from e


def init_projects(token: str) -> None:
    """
    ### The projects labml-app expects, and our fixed token

    labml-app files runs under a project token. Its local user (no login in a
    local setup) owns one project with a random token, and only that project's
    runs are listed on `/runs`. We index that project under a second, fixed token,
    `token` (`default`), so runs sent to `http://127.0.0.1:{port}/api/v1/default/`
    are listed. The float and samples projects are the ones `init_mongo_db`
    creates.
    """
    from labml_app import settings
    from labml_app.db import project, user

    project.create_project(settings.FLOAT_PROJECT_TOKEN, "float project")
    project.create_project(settings.SAMPLES_PROJECT_TOKEN, "samples project")
    local = user.get_or_create_user(identifier="local", is_local_user=True)
    project.ProjectIndex.set(token, local.default_project.key)


def static_dir() -> Path:
    """labml-app's built page (`index.html`, `js/bundle.min.js`, `css/`, images)."""
    import labml_app

    path = Path(labml_app.__file__).parent / "static"
    if not (path / "index.html").is_file():
        raise FileNotFoundError(f"labml-app's page is missing: no {path}/index.html")
    return path


def index_html(static: Path) -> str:
    """
    ### labml-app's `index.html` with the CDN tags pointing at our copies

    Each CDN tag is found by the package name in its URL and replaced whole (the
    `integrity` hash and `crossorigin` go with it). A CDN tag we have no copy for
    would leave the page blank or unstyled, so it is an error, not a silent gap.
    """
    html = (static / "index.html").read_text()

    def local(match: re.Match) -> str:
        tag, url = match.group(1), match.group(2)
        for name, (kind, path) in CDN_ASSETS.items():
            if re.search(rf"[/@.]{re.escape(name)}[@./]", url) and kind == tag:
                if tag == "script":
                    return f'<script src="/vendor/{path}"></script>'
                return f'<link href="/vendor/{path}" rel="stylesheet">'
        raise RuntimeError(f"labml-app's index.html loads {url} from the network; "
                           f"labml_zero/app/assets has no copy of it")

    # A script tag with an http(s) `src`, or a link tag with an http(s) `href`.
    tag = r'<(script|link)\b[^>]*?(?:src|href)="(https?://[^"]+)"[^>]*>(?:</script>)?'
    return re.sub(tag, local, html)


def asset_bytes(path: str) -> tuple[bytes, str]:
    """
    #### One bundled file and its media type

    Text files are stored gzipped (a third of their size in the package) and
    served plain, so any client reads them.
    """
    root = ASSETS.resolve()
    file = (ASSETS / path).resolve()
    # No `..` out of assets.
    if root not in file.parents:
        raise FileNotFoundError(path)
    media = MEDIA_TYPES.get(Path(path).suffix)
    if media is None:
        raise FileNotFoundError(path)
    if file.is_file():
        return file.read_bytes(), media
    packed = file.with_name(file.name + ".gz")
    if packed.is_file():
        return gzip.decompress(packed.read_bytes()), media
    raise FileNotFoundError(path)


class RequestGuard:
    """
    ## The guard in front of every route

    A plain ASGI middleware, so it sees the body as it arrives, before any
    handler has read it, and can refuse it without reading it: bad input gets a
    short 4xx. It checks a body's syntax and outer shape, not each field's type.
    The app stays on the loopback address unless told otherwise (see Note: no
    authentication).

    ### Note: every request passes one guard

    labml-app's handlers trust their input: a body that is not JSON, or not the shape
    they expect, raises inside them (the server's bare internal error and a
    traceback in the log), and a body is read whole, however large.
    `RequestGuard`, in front of every route, turns bad input into a short 4xx
    answer and one log line:

    1. A path with a NUL or another control character is a `400`.
    2. A body over the limit $L$ (`max_request_bytes`) is a `413`: before one byte is
       read when `Content-Length` declares it, else as soon as the bytes read pass
       $L$. No handler sees more than $L$ bytes of body.
    3. An API body that is not JSON, or is nested deeper than the parser's
       recursion allows, is a `400` with one log line; a run's (`track`,
       `computer`) must be an object or a list of objects, checked before the
       handler creates the run.
    4. A handler's `ValueError`, `TypeError`, `KeyError`, `AttributeError` or
       `IndexError` (input of a shape it does not handle) is a `400`; anything else,
       and a stored record that is not valid, a `500`. Either is logged as one line
       with the exception and where it was raised.

    A field of the wrong type inside a `track` body passes the guard (it checks a
    body's syntax and outer shape) and reaches the handler, which may have created
    the run before it fails.
    """

    def __init__(self, app, *, max_body: int):
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if re.search(r"[\x00-\x1f\x7f]", path):
            return await reply(send, 400, "the path has a NUL or control character")
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"0").decode("latin-1")
        if not declared.isdigit():
            return await reply(send, 400, f"bad Content-Length {declared!r}")
        # Refused before one byte is read; the server then closes the connection.
        if int(declared) > self.max_body:
            return await reply(send, 413, f"the body is over {self.max_body} bytes")
        body = await read_body(receive, self.max_body)
        if body is None:
            return await reply(send, 413, f"the body is over {self.max_body} bytes")
        # The handlers that a bad shape would leave half done.
        run_write = re.fullmatch(r"/api/v1/[^/]+/(?:track|computer)", path)
        problem = body and path.startswith("/api/") and \
            json_problem(body, run_write=bool(run_write))
        if problem:
            print(f"labml app: {scope['method']} {path}: 400 {problem[:200]}",
                  file=sys.stderr, flush=True)
            return await reply(send, 400, problem)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception as e:
            bad_input = isinstance(e, (ValueError, TypeError, KeyError,
                                       AttributeError, IndexError))
            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            message = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            # One line, instead of the server's traceback.
            print(f"labml app: {scope['method']} {path}: {message} ({where})",
                  file=sys.stderr, flush=True)
            if not started:
                status = 400 if bad_input else 500
                what = "the request" if bad_input else "the app"
                await reply(send, status, f"{what} failed: {message}")


async def read_body(receive, limit: int) -> bytes | None:
    """The whole body, or `None` once more than `limit` bytes have come."""
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def json_problem(body: bytes, *, run_write: bool) -> str | None:
    """What is wrong with an API request's body, or `None`."""
    try:
        data = json.loads(body)
    except ValueError as e:
        return f"the body is not JSON: {e}"
    except RecursionError:  # `[` repeated past Python's recursion limit
        return "the body's JSON is nested too deeply"
    items = data if isinstance(data, list) else [data]
    if run_write and not all(isinstance(d, dict) for d in items):
        return "a run's body must be a JSON object or a list of objects"
    return None


async def reply(send, status: int, message: str) -> None:
    """A short JSON answer, `{"error": message}`."""
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(config: AppConfig):
    """
    ## Build the FastAPI app

    The API handlers and the bundled page are labml-app's own, so its page
    looks and behaves as on app.labml.ai. labml-app answers each `track`
    request after a fixed 3 s pause (its way to batch a client's sends), so a
    run shows up a few seconds after it starts; here, a run's last request is
    answered at once.

    1. labml-app's settings from the environment, then the file storage and
       projects.
    2. labml-app's API handlers under `/api/v1/`, with the project token moved to
       where they read it (see Note: the token is in the path); its `track`
       and its runs list with one change each (see Note: a run's last request
       is not paused, Note: a damaged record costs only its run).
    3. `/vendor/...`: the CDN files from `assets`.
    4. Every other path: a file of labml-app's page if there is one, else our
       `index.html`, because the page routes on the client (`/runs`, `/run/<uuid>`).
    5. `RequestGuard` around all of it, outermost, so it also sees what the
       token middleware raises.
    """
    import_labml_app(config)
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse, HTMLResponse, Response
    from labml_app import handlers
    from labml_app.db import project
    from labml_app.logger import logger

    # labml-app logs every request at INFO; keep the console for errors.
    logger.setLevel("WARNING")
    # `labml_app.flask_app` connects to **MongoDB** when it is imported. labml-app's
    # storage layer, `labml_db`, also ships a **file-based** driver (one file per
    # record, one JSON file per index); we register it instead, with [records as
    # JSON](records.html) rather than pickles (see Note: records are JSON), and
    # never import `flask_app`.
    config.data_dir.mkdir(parents=True, exist_ok=True)
    init_file_db(config.data_dir)
    init_projects(config.token)

    static = static_dir()
    page = index_html(static)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    # first: a path's first route answers it
    app.add_api_route("/api/v1/{labml_token}/track", track_endpoint(),
                      methods=["POST"])
    app.add_api_route("/api/v1/runs/{labml_token}", runs_endpoint(),
                      methods=["GET"])
    handlers.add_handlers(app)

    # #### Note: the token is in the path
    #
    # labml's client puts the token where the route has it, in the path
    # (`/api/v1/default/track?run_uuid=...`): its `app_url` may not contain a `?`.
    # labml-app's `track` handler reads it from the query string (`labml_token=`)
    # and ignores the path, so every run would land in its "float" project, which
    # `/runs` never lists. This middleware copies the path's token into the query
    # string of `track` and `computer` requests that have none, before labml-app's
    # handler reads it. A token the app does not know becomes `default`: labml-app
    # would answer it with an `invalid_token` error, and labml's sender retries an
    # error forever, so the run would never exit.
    @app.middleware("http")
    async def token_from_path(request: Request, call_next):
        match = re.fullmatch(r"/api/v1/([^/]+)/(?:track|computer)", request.url.path)
        if match and "labml_token" not in request.query_params:
            token = match.group(1)
            if project.get_project(token) is None:
                token = config.token
            query = request.scope["query_string"].decode()
            request.scope["query_string"] = "&".join(
                filter(None, [query, f"labml_token={token}"])).encode()
        return await call_next(request)

    @app.get("/vendor/{path:path}")
    def vendor(path: str):
        try:
            data, media = asset_bytes(path)
        except FileNotFoundError:
            raise HTTPException(status_code=404, detail=f"no bundled file {path}")
        return Response(data, media_type=media,
                        headers={"Cache-Control": "max-age=86400"})

    @app.get("/{path:path}")
    def page_or_file(path: str):
        file = (static / path).resolve()
        if path and static.resolve() in file.parents and file.is_file() \
                and file.name != "index.html":
            return FileResponse(file)
        return HTMLResponse(page)

    # Added last, so it is outermost.
    app.add_middleware(RequestGuard, max_body=config.max_request_bytes)
    return app


def serve(config: AppConfig) -> None:
    """
    ## Run the app until interrupted

    One uvicorn worker in this process: the file drivers keep each index in memory
    and rewrite its file on every change, which is only safe with a single writer.
    The URLs are printed before it starts listening, so a script can read them
    from the first lines.
    """
    import uvicorn

    app = create_app(config)
    print(f"labml app: open {config.web_url}", flush=True)
    print(f"labml app: runs send to --app-url {config.api_url}", flush=True)
    print(f"labml app: data in {config.data_dir}", flush=True)
    # A data directory written by the earlier pickle storage is never read, by
    # design (see Note: records are JSON); saying so keeps old runs from seeming lost.
    pickles = ignored_pickles(config.data_dir)
    if pickles:
        print(f"labml app: ignoring {pickles} pickle records (*.pkl) in "
              f"{config.data_dir / 'models'}; records are JSON", flush=True)
    # #### Note: no authentication
    #
    # Whoever reaches the app's port can read, change and delete runs: it has no
    # login. It binds the loopback address by default; any other `--host` is
    # refused unless `--allow-remote` is given (`AppConfig`), and then the app
    # warns here, before it listens.
    if not is_loopback(config.host):
        print(f"labml app: WARNING: {config.host}:{config.port} can be reached from "
              f"other machines and the app has no authentication: anyone who "
              f"reaches it can read, change and delete runs", file=sys.stderr,
              flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")


def check_data_dir(path: Path) -> None:
    """
    #### A data directory the app can write, made if missing

    One temporary file is written and removed: a read-only mount or a quota
    shows only then. Found at start, not at the first run's first record.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"--data-dir {path} is not writable "
                         f"({e.strerror or e})") from e


def main(argv: list[str] | None = None) -> None:
    """`python -m labml_zero.app [--port N] [--host H] [--data-dir D] ...`"""
    defaults = AppConfig()
    prog = "python -m labml_zero.app"
    p = argparse.ArgumentParser(prog=prog, description="The labml app, offline.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--port", type=int, default=defaults.port, help="TCP port")
    p.add_argument("--host", default=defaults.host, help="address to bind")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host other machines can reach (no authentication)")
    p.add_argument("--data-dir", type=Path, default=defaults.data_dir,
                   help="where runs are stored, as JSON files")
    p.add_argument("--max-request-mib", type=float,
                   default=defaults.max_request_bytes / 2**20,
                   help="largest request body accepted, in MiB")
    args = p.parse_args(argv)
    try:
        if not 0 < args.max_request_mib < 2**20:
            raise ValueError(f"--max-request-mib must be in (0, 1048576), "
                             f"got {args.max_request_mib}")
        config = AppConfig(host=args.host, port=args.port, data_dir=args.data_dir,
                           allow_remote=args.allow_remote,
                           max_request_bytes=int(args.max_request_mib * 2**20))
        check_data_dir(config.data_dir)
    except ValueError as e:
        # One line, without argparse's usage text.
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        serve(config)
    except ImportError as e:
        if not e.name:
            sys.exit(f"{prog}: error: {e}")
        sys.exit(f"{prog}: error: no module named {e.name!r}: the app extra is not "
                 f"installed; run bash setup.sh, or pip install -e '.[app]'")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
