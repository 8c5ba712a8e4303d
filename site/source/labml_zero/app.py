"""
---
title: python -m labml_zero.app
summary: The labml app on this machine, offline - labml-app's API and page, with its
  file-based storage instead of MongoDB and its CDN scripts served from the package.
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
working on an offline machine:

* `labml_app.flask_app` connects to **MongoDB** when it is imported. labml-app's
  storage layer, `labml_db`, also ships a **file-based** driver pair (one pickle
  file per record, one JSON file per index); we register those instead and never
  import `flask_app`.
* its `index.html` loads **d3 v6, Bootstrap 5.0.0-beta2 and Font Awesome 5.9.0 from
  CDNs**; without them the page stays blank. The same files, from their npm
  packages, ship in `labml_zero/app_assets/` (about 300 KB, licenses in its
  `NOTICE`), and we serve an `index.html` whose three tags point at them.

Everything else, the API handlers and the bundled page, is labml-app's own, so its
page looks and behaves as on app.labml.ai.

## Projects and the URL a run sends to

labml-app files runs under a project token. Its local user (no login in a local
setup) owns one project with a random token, and only that project's runs are
listed on `/runs`. We index that project under a second, fixed token, `default`, so
runs sent to `http://127.0.0.1:{port}/api/v1/default/` are listed.

## Note: the token is in the path

labml's client puts the token where the route has it, in the path
(`/api/v1/default/track?run_uuid=...`): its `app_url` may not contain a `?`.
labml-app's `track` handler reads it from the query string (`labml_token=`) and
ignores the path, so every run would land in its "float" project, which `/runs`
never lists. A middleware copies the path's token into the query string of `track`
and `computer` requests that have none, before labml-app's handler reads it. A
token the app does not know becomes `default`: labml-app would answer it with an
`invalid_token` error, and labml's sender retries an error forever, so the run
would never exit.

## Limitations

* One worker process: the file drivers keep each index in memory and rewrite its
  file on every change, which is only safe with a single writer.
* Records are pickles of labml-app's classes: a data directory written by one
  labml-app version may not load with another.
* labml-app answers each `track` request after a fixed 3 s pause (its way to batch
  a client's sends), so a run shows up a few seconds after it starts.
* No authentication: the server listens on 127.0.0.1 by default; a `--host` that
  others can reach lets them read and delete runs.
"""

import argparse
import gzip
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AppConfig", "create_app", "serve", "main"]

ASSETS = Path(__file__).parent / "app_assets"

# index.html tag -> where the same file lives in app_assets (served under /vendor/).
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
    """TCP port; 5005 is labml's default app port."""
    data_dir: Path = field(
        default_factory=lambda: Path.home() / ".labml_zero" / "app")
    """Runs, series and indexes, as files; created if missing."""
    token: str = "default"
    """Project token in the API URL runs send to (see "Projects and the URL")."""

    def __post_init__(self):
        if not self.host:
            raise ValueError("host must be a non-empty address, e.g. '127.0.0.1'")
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
        raise ImportError("labml-app is not installed; install the app extra: "
                          "pip install -e '.[app]'") from e


def init_file_db(data_dir: Path) -> None:
    """
    ### Register labml_db's file drivers for every labml-app model and index

    The same model and index lists as labml-app's `init_mongo_db`, and the same
    pickle serialization its Mongo driver uses; only the storage differs.
    """
    from labml_app import db
    from labml_db import Index, Model
    from labml_db.driver.file import FileDbDriver
    from labml_db.index_driver.file import FileIndexDbDriver
    from labml_db.serializer.json import JsonSerializer
    from labml_db.serializer.pickle import PickleSerializer

    # `db.models` and `db.indexes` include the analyses' (series, logs, ...).
    Model.set_db_drivers([FileDbDriver(PickleSerializer(), m,
                                       data_dir / "models" / m.__name__)
                          for m in db.models])
    Index.set_db_drivers([FileIndexDbDriver(JsonSerializer(), i,
                                            data_dir / "indexes" / f"{i.__name__}.json")
                          for i in db.indexes])


def init_projects(token: str) -> None:
    """
    ### The projects labml-app expects, and our fixed token

    The float and samples projects are the ones `init_mongo_db` creates. The local
    user's project gets `token` as a second index entry (see "Projects and the URL").
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
                           f"labml_zero/app_assets has no copy of it")

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
    # No `..` out of app_assets.
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


def create_app(config: AppConfig):
    """
    ## Build the FastAPI app

    1. labml-app's settings from the environment, then the file storage and
       projects.
    2. labml-app's API handlers under `/api/v1/`, with the project token moved to
       where they read it (see Note: the token is in the path).
    3. `/vendor/...`: the CDN files from `app_assets`.
    4. Every other path: a file of labml-app's page if there is one, else our
       `index.html`, because the page routes on the client (`/runs`, `/run/<uuid>`).
    """
    import_labml_app(config)
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse, HTMLResponse, Response
    from labml_app import handlers
    from labml_app.db import project
    from labml_app.logger import logger

    # labml-app logs every request at INFO; keep the console for errors.
    logger.setLevel("WARNING")
    config.data_dir.mkdir(parents=True, exist_ok=True)
    init_file_db(config.data_dir)
    init_projects(config.token)

    static = static_dir()
    page = index_html(static)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    handlers.add_handlers(app)

    @app.middleware("http")
    async def token_from_path(request: Request, call_next):
        # see Note: the token is in the path
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

    return app


def serve(config: AppConfig) -> None:
    """
    ## Run the app until interrupted

    One uvicorn worker in this process (see Limitations); the URLs are printed
    before it starts listening, so a script can read them from the first lines.
    """
    import uvicorn

    app = create_app(config)
    print(f"labml app: open {config.web_url}", flush=True)
    print(f"labml app: runs send to --app-url {config.api_url}", flush=True)
    print(f"labml app: data in {config.data_dir}", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")


def main(argv: list[str] | None = None) -> None:
    """`python -m labml_zero.app [--port N] [--host H] [--data-dir D]`"""
    defaults = AppConfig()
    p = argparse.ArgumentParser(prog="python -m labml_zero.app",
                                description="The labml app, offline, with file "
                                            "storage.")
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--data-dir", type=Path, default=defaults.data_dir)
    args = p.parse_args(argv)
    try:
        config = AppConfig(host=args.host, port=args.port, data_dir=args.data_dir)
    except ValueError as e:
        p.error(str(e))
    try:
        serve(config)
    except ImportError as e:
        sys.exit(f"labml_zero.app: {e}")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
