"""`invoke stage-weights MODEL`: put a model's weights into the store of every serving host.

Parses and prints; sparkprov/plays/stage.py runs the plays: store check, download once, send, publish.

data, engine and plays load inside the functions, not at the top: tasks.py imports every cli module,
and `invoke --list` stays fast.
"""

from __future__ import annotations

import sys

from invoke import task

from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.cli.options import (OptionError, csv_option, float_option, int_option, parse_forks, positional,
                                   revision_option)
from sparkprov.defaults import DEFAULT_FORKS

# a repo path pattern: fnmatch's * ? [ ] and the characters of hub file names
PATH_PATTERN = r"[A-Za-z0-9._*?\[\]/+=@-]+"
PATH_PATTERN_TEXT = "a file pattern such as '*.safetensors' or 'original/*' (letters, digits, . _ - / + = @ and * ? [ ])"

STAGE_HELP = {
    "model": "Catalog alias (e.g. qwen3.5-122b) or a Hugging Face repo id ORG/NAME[@REVISION]",
    "hosts": "Hosts, groups or patterns to stage on, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the selected hosts (pattern, e.g. 'spark2' or '!spark1')",
    "check": "Print the plan per host (what is missing, partial, unverified; bytes; free space) and transfer nothing",
    "rehash": "Hash every file again, even those recorded as verified with unchanged size and mtime",
    "json": "Print one JSON document at the end ({ok, hosts, results, stage}) instead of the recap",
    "source": "Host that downloads from the hub and feeds the others (default: the control machine when it is "
              "in the play, else the first host)",
    "streams": "Most whole-file sends at once, all receivers together: what the source held, small files, "
               "resumed partials (default 4; a weight downloading now streams to each receiver beside these)",
    "image": "Image that runs huggingface_hub on the downloading host (default: the recipe's serving image, "
             "else the inventory var stage_image)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
    "progress_interval": "Kept for scripts; the engine reports each step as it ends",
    "forks": "How many hosts to work on at once (default 32)",
    "revision": "The model repo at this branch, tag or commit (default: the recipe's, else main)",
    "include": "Stage only the model repo's files matching these patterns, comma-separated, as hf download "
               "--include takes them (e.g. '*.safetensors,*.json')",
    "exclude": "Leave out the model repo's files matching these patterns, comma-separated (e.g. 'original/*')",
}


# streams and progress_interval default to None so that Invoke hands their text over as typed
# (an int or float default makes Invoke cast it itself, and `--streams abc` ends in a traceback);
# sparkprov.cli.options parses and range-checks them.
@task(help=STAGE_HELP)
def stage_weights(c, model, hosts=None, inventory=None, limit=None, check=False, rehash=False, json=False, source=None,
                  streams=None, image=None, accept_new_host_keys=False, progress_interval=None, forks=None,
                  revision=None, include=None, exclude=None):
    """Stage a model's weights into every host's store: download once, fan out over the fabric, verify."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays.stage import StageOptions, run_stage

    out = sys.stderr if json else sys.stdout
    with user_errors():
        positional("stage-weights", "model", model)
        streams = int_option("streams", streams, 1, 64, default=4)
        forks = parse_forks(forks, DEFAULT_FORKS)
        float_option("progress-interval", progress_interval, 0, 3600, default=5.0, unit="seconds")
        revision = revision_option("revision", revision)
        model = model_argument(model)
        include = csv_option("include", include, pattern=PATH_PATTERN, allowed_text=PATH_PATTERN_TEXT)
        exclude = csv_option("exclude", exclude, pattern=PATH_PATTERN, allowed_text=PATH_PATTERN_TEXT)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        report = Report(out, quiet=json)
        summary = run_stage(inv, targets, model, StageOptions(check=check, rehash=rehash, source=source, streams=streams,
                                                              image=image, accept_new_host_keys=accept_new_host_keys,
                                                              forks=forks, revision=revision, include=include,
                                                              exclude=exclude), report)
        src = summary["source"]
    print_report(report, json, stage=summary)
    if not json:
        print(f"\n{model}: {summary['files']} files, {_h(summary['bytes'])}; source {src}; "
              f"{summary['seconds']:.1f}s" + (" (check: nothing transferred)" if check else ""))
    finish(report.exit_code())


def model_argument(model) -> str:
    """The MODEL argument: an alias, or ORG/NAME[@REVISION] whose revision is checked as
    --revision's is (it went to the hub unchecked)."""
    positional("stage-weights", "model", model)
    repo, at, rev = model.partition("@")
    if at and (not rev or "/" not in repo):
        raise OptionError(f"MODEL {model!r}: a revision follows ORG/NAME after '@'",
                          fix=f"give ORG/NAME@REVISION, e.g. {repo if '/' in repo else 'org/name'}@main")
    if at:
        try:
            revision_option("revision", rev)
        except OptionError as exc:
            raise OptionError(f"MODEL {model!r}: {exc.message.removeprefix('--revision ')}",
                              fix=f"e.g. {repo}@main, {repo}@refs/pr/1 or {repo}@<a 40-character commit id>") from None
    return model


def _h(n: int) -> str:
    from sparkprov.staging.plan import human

    return human(n)
