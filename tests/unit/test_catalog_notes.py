"""Every seed recipe renders the exact command its note gives, apart from sparkprov's house rules
(render.py's docstring) and the recipe's own documented `corrections`."""

import json
import shlex
from dataclasses import dataclass, field

import pytest

from sparkprov.catalog.load import load_catalog
from sparkprov.catalog.render import HostServeContext, render_launch

CAT = load_catalog()
# A host shaped like the notes' (store at /models, port 8000, bind 0.0.0.0) so paths compare literally.
CTX = HostServeContext(model_store="/models", bind_host="0.0.0.0", port=8000)
WITH_NOTE = sorted(a for a, r in CAT.recipes.items() if r.note_command)

DOCKER_VALUE_OPTS = {"--name", "--restart", "--gpus", "-p", "-e", "-v", "--shm-size", "--runtime", "--network",
                     "--ulimit", "--entrypoint", "--ipc", "--user", "--label"}
HOUSE_ENV = {"HF_HOME", "HF_TOKEN", "VLLM_API_KEY"}
HOUSE_FLAGS = {"--host", "--port"}


@dataclass
class Note:
    image: str | None = None
    env: dict = field(default_factory=dict)
    mounts: list = field(default_factory=list)  # (host, container, ro)
    shm_size: str | None = None
    ulimits: list = field(default_factory=list)
    style: str = "bare"  # bare | full | python
    pre: list = field(default_factory=list)
    model: str | None = None  # positional model
    args: list = field(default_factory=list)  # (flag, value)


def _split_args(words):
    model, args = None, []
    i = 0
    if words and not words[0].startswith("--"):
        model, i = words[0], 1
    while i < len(words):
        w = words[i]
        assert w.startswith("--"), f"unexpected word {w!r}"
        if "=" in w:
            name, _, value = w.partition("=")
            args.append((name, value))
            i += 1
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            args.append((w, words[i + 1]))
            i += 2
        else:
            args.append((w, None))
            i += 1
    return model, args


def parse_note(text: str) -> Note:
    note = Note()
    lines = [l for l in text.replace("\\\n", " ").splitlines() if l.strip()]
    for line in lines:
        words = shlex.split(line)
        if words[0] == "export":
            k, _, v = words[1].partition("=")
            note.env[k] = v
            continue
        if words[0].endswith("docker") and words[1] == "run":
            i, entry = 2, None
            while words[i].startswith("-"):
                w = words[i]
                name, eq, val = w.partition("=")
                if eq:
                    i += 1
                elif w in DOCKER_VALUE_OPTS:
                    val, i = words[i + 1], i + 2
                else:
                    i += 1
                    continue
                if name == "-e":
                    k, _, v = val.partition("=")
                    note.env[k] = v
                elif name == "-v":
                    parts = val.split(":")
                    note.mounts.append((parts[0], parts[1], len(parts) > 2 and parts[2] == "ro"))
                elif name == "--shm-size":
                    note.shm_size = val
                elif name == "--ulimit":
                    note.ulimits.append(val)
                elif name == "--entrypoint":
                    entry = val
            note.image = words[i]
            rest = words[i + 1:]
            if entry:  # --entrypoint /bin/bash IMAGE -c "pre && vllm serve ..."
                assert rest[0] == "-c"
                *pre, serve = rest[1].split("&&")
                note.pre = [shlex.split(p) for p in pre]
                rest = shlex.split(serve)
                note.style = "shell"
            if rest[:2] == ["vllm", "serve"]:
                note.style = "full" if note.style != "shell" else "shell"
                rest = rest[2:]
            note.model, note.args = _split_args(rest)
        elif words[:2] == ["vllm", "serve"]:
            note.style = "full"
            note.model, note.args = _split_args(words[2:])
        elif words[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]:
            note.style = "python"
            note.model, note.args = _split_args(words[3:])
    return note


def expected_from_note(recipe) -> tuple[Note, set]:
    """The note's command with the house rules and the recipe's corrections applied."""
    note = parse_note(recipe.note_command.text)
    store_targets = {note.env.get("HF_HOME"), "/root/.cache/huggingface"}
    note.mounts = [m for m in note.mounts if m[1] not in store_targets]
    note.env = {k: v for k, v in note.env.items() if k not in HOUSE_ENV}
    note.args = [(f, v) for f, v in note.args if f not in HOUSE_FLAGS]
    added = set()
    for c in recipe.corrections:
        kind, *names = c.what.split()
        if kind == "image":
            assert note.image == c.note_value
            note.image = c.value
        elif kind == "command":
            assert c.reason
        elif kind == "drop-env":
            assert names[0] in note.env, c.what
            if c.note_value is not None:
                assert note.env[names[0]] == c.note_value
            del note.env[names[0]]
        elif kind == "add-env":
            assert names[0] not in note.env
            note.env[names[0]] = c.value
        elif kind == "drop-flag":
            got = dict(note.args)
            assert names[0] in got and (c.note_value is None or got[names[0]] == c.note_value), c.what
            note.args = [(f, v) for f, v in note.args if f != names[0]]
        elif kind == "add-flag":
            assert names[0] not in dict(note.args)
            note.args.append((names[0], c.value))
            added.add(names[0])
        elif kind == "env-to-flag":
            env, flag = names
            assert note.env.pop(env) == c.note_value, c.what
            note.args = [(f, v) for f, v in note.args if f != flag] + [(flag, c.value)]
            added.add(flag)
        elif kind == "model-positional":  # the note's `--model X` becomes vllm serve's positional X
            got = dict(note.args)
            assert note.model is None and got.get("--model") == c.value, c.what
            assert c.note_value == f"--model {c.value}"
            note.args = [(f, v) for f, v in note.args if f != "--model"]
            note.model = c.value
        elif kind == "env-to-model":
            assert note.env.pop(names[0]) == c.note_value
            note.model = c.value
        elif kind == "drop-mount":
            assert any(m[1] == names[0] for m in note.mounts), c.what
            note.mounts = [m for m in note.mounts if m[1] != names[0]]
        else:
            raise AssertionError(f"unknown correction kind {kind!r}")
    return note, added


@pytest.mark.parametrize("alias", WITH_NOTE)
def test_catalog_renders_the_note_command(alias):
    recipe = CAT.get(alias)
    note, added = expected_from_note(recipe)
    launch = render_launch(recipe, CTX, min(recipe.tp_sizes), catalog=CAT)

    assert recipe.image == note.image
    env = {e.name: e.value for e in launch.env if e.origin == "recipe"}
    assert env == note.env
    positional = [a.value for a in launch.vllm_args if a.flag is None]
    assert positional == ([note.model] if note.model else [])
    got = [(a.flag, a.value) for a in launch.vllm_args if a.flag is not None and a.origin != "host"]
    assert dict(got) == dict(note.args)
    in_note_order = [f for f, _ in note.args if f not in added]
    assert [f for f, _ in got if f not in added] == in_note_order
    mounts = {(m.container, m.read_only, m.host.rsplit("/", 1)[-1]) for m in launch.mounts
              if m.container not in (CTX.model_store, "/root/.cache/vllm", "/run/secrets/sparkprov_api_key")}
    assert mounts == {(c, ro, h.rstrip("/").rsplit("/", 1)[-1]) for h, c, ro in note.mounts}
    assert recipe.docker.shm_size == note.shm_size
    assert recipe.docker.ulimits == note.ulimits
    assert recipe.pre_serve == note.pre
    # the image takes the command the way the note wrote it (or a correction says why not)
    if any(c.what == "command" for c in recipe.corrections):
        assert note.style in ("python", "bare")  # documented: env-driven entrypoint / native install
    elif note.style in ("full", "bare"):
        assert launch.command == note.style
    else:
        assert note.style == "shell" and launch.wrapped


def test_catalog_every_seed_recipe_has_its_note_command():
    mine = {a for a, r in CAT.recipes.items() if r.source.note != "sparkprov"}
    assert mine == set(WITH_NOTE)
    notes = {CAT.get(a).source.note for a in WITH_NOTE}
    assert notes == {"000", "001", "002", "003", "004"}


def test_catalog_aliases_named_in_the_issue_exist():
    for alias in ("qwen3.5-122b", "qwen3.6-35b-a3b", "qwen3.6-27b", "qwen3-coder-next", "qwen3.5-35b-a3b-fp8",
                  "gemma-4-31b", "gemma-4-26b-a4b", "gemma-4-12b-coder", "nemotron-3-nano", "nemotron-3-nano-omni",
                  "gpt-oss-120b", "qwen3-next-80b-gptq", "llama-3.3-70b", "qwen3.6-35b-a3b-dflash",
                  "qwen3.6-27b-dflash", "qwen3.6-27b-mtp", "gemma-4-12b-coder-mtp", "qwen3.5-27b-dflash"):
        assert alias in CAT.recipes


def test_catalog_note_parser_reads_the_omni_shell_entrypoint():
    note = parse_note(CAT.get("nemotron-3-nano-omni").note_command.text)
    assert note.pre == [["pip", "install", "vllm[audio]"]]
    assert note.model == "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-NVFP4"
    assert dict(note.args)["--limit-mm-per-prompt"] == '{"video":1,"image":1,"audio":1}'
    assert json.loads(dict(note.args)["--media-io-kwargs"]) == {"video": {"fps": 2, "num_frames": 256}}
