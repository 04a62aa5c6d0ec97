"""What to stage, from the hub: read on the control machine with huggingface_hub's HfApi.

A model is a catalog alias (its repo, revision, extra repos and extra files) or a repo id
(`ORG/NAME[@REVISION]`). The listing pins every revision to a commit id and gives each file its
size, git blob id and, for LFS files, its sha256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from sparkprov.errors import SparkprovError
from sparkprov.staging.plan import Item

DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass
class StageSpec:
    """What the model needs in the store, before the hub is asked."""

    label: str
    image: str | None
    gated: bool
    repos: list[tuple[str, str, str | None]] = field(default_factory=list)  # (repo, revision, local_dir)
    files: list[tuple[str, str, str, str]] = field(default_factory=list)    # (repo, revision, filename, dest)


def spec_for(model: str, revision: str | None = None) -> StageSpec:
    """A catalog alias, or a repo id ORG/NAME[@REVISION]. `revision` (--revision: a branch, tag
    or commit) replaces the model repo's revision; the recipe's extra repos keep theirs."""
    if "/" in model:
        repo, _, rev = model.partition("@")
        if rev and revision and rev != revision:
            raise SparkprovError(f"{model} names revision {rev!r} and --revision says {revision!r}",
                                 fix="give the revision once, as ORG/NAME@REV or as --revision")
        return StageSpec(label=repo, image=None, gated=False, repos=[(repo, revision or rev or "main", None)])
    from sparkprov.catalog.load import load_catalog

    recipe = load_catalog().get(model)
    spec = StageSpec(label=model, image=recipe.image, gated=recipe.gated,
                     repos=[(recipe.model.repo, revision or recipe.model.revision, recipe.model.local_dir)])
    for x in recipe.extra_repos:
        spec.repos.append((x.repo, x.revision, None))
    for s in recipe.stage:
        spec.files.append((s.repo, s.revision, s.filename, s.dest))
    return spec


def resolve_token() -> tuple[str | None, str]:
    """The user's Hugging Face token and where it came from: HF_TOKEN (or the older
    HUGGING_FACE_HUB_TOKEN), else the token file huggingface_hub keeps (`hf auth login`)."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(var, "").strip():
            return _checked_token(os.environ[var].strip(), f"${var}"), f"${var}"
    from huggingface_hub import constants

    from sparkprov.inputfiles import MAX_SECRET, read_text_checked

    path = os.environ.get("HF_TOKEN_PATH") or constants.HF_TOKEN_PATH
    if not os.path.lexists(path):
        return None, ""
    # the token file too is checked to be a small regular file (a FIFO would block the run)
    tok = read_text_checked(path, "Hugging Face token file", MAX_SECRET).strip()
    return (_checked_token(tok, path) if tok else None), path


def _checked_token(token: str, source: str) -> str:
    """A token is one word of printable ASCII. A newline inside (a pasted second line, two tokens
    in one file) would end up in an HTTP header, where httpx refuses it with a traceback, or in the
    token file on the downloading host. The message names where it came from, never the value."""
    if not token.isascii() or any(not c.isprintable() or c.isspace() for c in token):
        raise SparkprovError(f"the Hugging Face token from {source} contains whitespace, a line break or "
                             "another character a token cannot have",
                             fix=f"put only the token (one line, hf_...) in {source}")
    return token


def check_endpoint(endpoint: str) -> str:
    """The hub endpoint as an http(s) URL with a host (from hf_endpoint in the inventory)."""
    from urllib.parse import urlsplit

    fix = "set hf_endpoint in the inventory to an http(s) URL such as https://huggingface.co"
    if not isinstance(endpoint, str) or any(not c.isprintable() or c.isspace() for c in endpoint):
        raise SparkprovError(f"hub endpoint {endpoint!r} contains whitespace or control characters", fix=fix)
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number 0..65535)
    except ValueError as exc:
        raise SparkprovError(f"hub endpoint {endpoint!r} is not a URL: {exc}", fix=fix) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SparkprovError(f"hub endpoint {endpoint!r} is not an http(s) URL with a host", fix=fix)
    return endpoint.rstrip("/")


def check_repo_id(repo: str, model: str | None = None) -> str:
    """ORG/NAME as the hub accepts it (huggingface_hub's own rule), before any request."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise SparkprovError(f"{repo!r} is not a Hugging Face repo id",
                             fix="give a catalog alias (invoke models) or ORG/NAME[@REVISION]: letters, digits, "
                                 "'-', '_', '.', at most 96 characters") from None
    return repo


def endpoint_env(endpoint: str) -> dict[str, str]:
    """Environment for huggingface_hub against this endpoint (Xet only on the real hub)."""
    env = {"HF_ENDPOINT": endpoint.rstrip("/")}
    if endpoint.rstrip("/") != DEFAULT_ENDPOINT:
        env["HF_HUB_DISABLE_XET"] = "1"
    return env


@dataclass
class RepoListing:
    repo: str
    revision: str
    commit: str
    gated: bool
    files: list[Item]


def _api(endpoint: str):
    for k, v in endpoint_env(endpoint).items():
        os.environ.setdefault(k, v)  # read by huggingface_hub at import
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint.rstrip("/"))


def list_repo(endpoint: str, repo: str, revision: str, token: str | None, *, gated_hint: bool = False,
              local_dir: str | None = None) -> RepoListing:
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    api = _api(endpoint)
    tok = token or False
    try:
        info = api.model_info(repo, revision=revision, token=tok)
        commit = info.sha
        gated = bool(info.gated) or gated_hint
        if gated and not token:
            raise SparkprovError(
                f"{repo} is gated and no Hugging Face token was found; nothing was transferred",
                fix=f"accept the license on {endpoint.rstrip('/')}/{repo}, then set HF_TOKEN or run "
                    "`hf auth login` on this machine (sparkprov passes the token to the downloading host)")
        tree = [f for f in api.list_repo_tree(repo, recursive=True, revision=commit, token=tok)
                if hasattr(f, "blob_id")]
    except RepositoryNotFoundError:
        raise SparkprovError(f"{repo}: repository not found on {endpoint}",
                             fix="check the repo id (or the token, for a private repo)") from None
    except RevisionNotFoundError:
        raise SparkprovError(f"{repo}: revision {revision!r} not found on {endpoint}", fix="check the revision") from None
    except HfHubHTTPError as exc:
        raise SparkprovError(f"{repo}: the hub at {endpoint} answered: {str(exc).splitlines()[0]}",
                             fix="check hf_endpoint in the inventory and the network") from None
    except OSError as exc:
        raise SparkprovError(f"{repo}: cannot reach the hub at {endpoint}: {exc}",
                             fix="check hf_endpoint in the inventory and the network") from None
    except Exception as exc:
        if not _transport_error(exc):
            raise
        raise _network_error(exc, endpoint, repo) from None
    if gated:
        _check_access(api, endpoint, repo, commit, tree, token, GatedRepoError, HfHubHTTPError)
    items = []
    for f in sorted(tree, key=lambda f: f.path):
        if f.path == ".gitattributes":
            continue
        dest = f"{local_dir.rstrip('/')}/{f.path}" if local_dir else None
        items.append(Item(repo=repo, revision=revision, commit=commit, path=f.path, size=int(f.size),
                          oid=f.blob_id, sha256=f.lfs.sha256 if f.lfs else None, dest=dest))
    return RepoListing(repo, revision, commit, gated, items)


def _check_access(api, endpoint, repo, commit, tree, token, GatedRepoError, HfHubHTTPError) -> None:
    """A gated repo: prove the token opens it (one HEAD) before any host moves a byte."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    if not tree:
        return
    url = hf_hub_url(repo, tree[0].path, revision=commit, endpoint=endpoint.rstrip("/"))
    try:
        get_hf_file_metadata(url, token=token)
    except GatedRepoError:
        raise SparkprovError(f"{repo} is gated and the token was refused; nothing was transferred",
                             fix=f"accept the license on {endpoint.rstrip('/')}/{repo} with the account of the token, "
                                 "or set HF_TOKEN to a token of an account that has access") from None
    except HfHubHTTPError as exc:
        code = getattr(getattr(exc, "response", None), "status_code", None)
        if code in (401, 403):
            raise SparkprovError(f"{repo}: the hub refused the token ({code}); nothing was transferred",
                                 fix="check HF_TOKEN / `hf auth login` (a 401 means a bad token or no access)") from None
        raise SparkprovError(f"{repo}: the hub at {endpoint} answered: {_first_line(exc)}",
                             fix="check hf_endpoint in the inventory and the network") from None
    except Exception as exc:
        if not _transport_error(exc):
            raise
        raise _network_error(exc, endpoint, repo) from None


def _transport_error(exc: BaseException) -> bool:
    """An error of huggingface_hub's HTTP client (connect, timeout, TLS, protocol, a bad URL):
    whichever httpx package this huggingface_hub uses, found through its own errors module."""
    import sys

    from huggingface_hub.errors import HTTPError

    client = sys.modules.get(HTTPError.__module__.split(".")[0])
    others = tuple(t for t in (getattr(client, "InvalidURL", None), getattr(client, "CookieConflict", None))
                   if isinstance(t, type))
    return isinstance(exc, (HTTPError, *others))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _network_error(exc: BaseException, endpoint: str, repo: str) -> SparkprovError:
    kind = type(exc).__name__
    if "Timeout" in kind:
        what = "timed out"
    elif kind in ("UnsupportedProtocol", "InvalidURL"):
        what = "is not a usable URL"
    else:
        what = "cannot be reached"
    return SparkprovError(f"{repo}: the hub at {endpoint} {what} ({kind}: {_first_line(exc)})",
                          fix="check hf_endpoint in the inventory, the network and any proxy settings "
                              "(HTTPS_PROXY) of this machine")


def list_stage(spec: StageSpec, endpoint: str, token: str | None, *, include: list[str] | None = None,
               exclude: list[str] | None = None) -> tuple[list[Item], list[RepoListing]]:
    """Every item of the stage, each revision pinned to a commit. `include`/`exclude` are
    `hf download`'s --include/--exclude: fnmatch patterns on the repo paths of the model repo's
    files, matched by huggingface_hub's own filter_repo_objects (the files a recipe stages by name
    are always staged). A pattern that matches nothing is an error, not an empty stage."""
    endpoint = check_endpoint(endpoint)
    for repo, _rev, *_ in spec.repos + spec.files:
        check_repo_id(repo)
    if spec.gated and not token:  # the catalog knows it: say so before the hub is asked (it may be down)
        repo = spec.repos[0][0]
        raise SparkprovError(f"{spec.label}: {repo} is gated and no Hugging Face token was found; nothing was "
                             "contacted", fix=f"accept the license on {endpoint}/{repo}, then set HF_TOKEN or run "
                                              "`hf auth login` on this machine (sparkprov passes the token to the "
                                              "downloading host)")
    listings: dict[tuple[str, str], RepoListing] = {}
    items: list[Item] = []
    for repo, rev, local_dir in spec.repos:
        lst = list_repo(endpoint, repo, rev, token, gated_hint=spec.gated and repo == spec.repos[0][0],
                        local_dir=local_dir)
        listings[(repo, rev)] = lst
        files = lst.files
        if repo == spec.repos[0][0] and (include or exclude):
            files = filtered(lst, include, exclude)
        items.extend(files)
    for repo, rev, filename, dest in spec.files:
        lst = listings.get((repo, rev))
        if lst is None:
            lst = listings[(repo, rev)] = list_repo(endpoint, repo, rev, token)
        match = [i for i in lst.files if i.path == filename]
        if not match:
            raise SparkprovError(f"{repo}@{rev}: the recipe stages {filename}, which the repo does not have",
                                 fix="fix the recipe's stage: entry")
        m = match[0]
        items.append(Item(repo=m.repo, revision=m.revision, commit=m.commit, path=m.path, size=m.size,
                          oid=m.oid, sha256=m.sha256, dest=dest))
    return items, list(listings.values())


def filtered(lst: RepoListing, include: list[str] | None, exclude: list[str] | None) -> list[Item]:
    from huggingface_hub.utils import filter_repo_objects

    where = f"{lst.repo}@{lst.revision}"
    for flag, patterns in (("--include", include), ("--exclude", exclude)):
        for p in patterns or []:
            if not list(filter_repo_objects(lst.files, allow_patterns=[p], key=lambda i: i.path)):
                raise SparkprovError(f"{flag} {p!r} matches no file of {where}",
                                     fix="check the pattern against the repo's files (e.g. '*.safetensors', 'original/*')")
    kept = list(filter_repo_objects(lst.files, allow_patterns=include or None, ignore_patterns=exclude or None,
                                    key=lambda i: i.path))
    if not kept:
        raise SparkprovError(f"--include/--exclude leave no file of {where} to stage",
                             fix="loosen the patterns")
    return kept
