"""`invoke stage-weights MODEL`: put a model's weights into the store of every serving host.

Parses and prints; sparkprov/plays/stage.py runs the plays: store check, download once, send, publish.

data, engine and plays load inside the functions, not at the top (sparkprov/cli/command.py says why).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.options import Flag, Image, Int, Number, OptionError, Revision, Text, Words, common, option, revision_option

# a repo path pattern: fnmatch's * ? [ ] and the characters of hub file names
PATH_PATTERN = Words(pattern=r"[A-Za-z0-9._*?\[\]/+=@-]+",
                     allowed_text="a file pattern such as '*.safetensors' or 'original/*' (letters, digits, "
                                  ". _ - / + = @ and * ? [ ])")


@dataclass
class StageOptions:
    model: str = option("Catalog alias (e.g. qwen3.5-122b) or a Hugging Face repo id ORG/NAME[@REVISION]",
                        positional=True)
    hosts: str | None = common("hosts", "Hosts, groups or patterns to stage on, comma-separated (default: all in "
                                        "the inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    check: bool = option("Print the plan per host (what is missing, partial, unverified; bytes; free space) and "
                         "transfer nothing", Flag())
    rehash: bool = option("Hash every file again, even those recorded as verified with unchanged size and mtime",
                          Flag())
    json: bool = common("json")
    source: str | None = option("Host that downloads from the hub and feeds the others (default: the control "
                                "machine when it is in the play, else the first host)", Text(max_len=256))
    streams: int = option("Most whole-file sends at once, all receivers together: what the source held, small "
                          "files, resumed partials (default 4; a weight downloading now streams to each receiver "
                          "beside these)", Int(1, 64), default=4)
    image: str | None = option("Image that runs huggingface_hub on the downloading host (default: the recipe's "
                               "serving image, else the inventory var stage_image)",
                               Image(example="vllm/vllm-openai:v0.19.1"))
    accept_new_host_keys: bool = common("accept_new_host_keys")
    progress_interval: float = option("Kept for scripts; the engine reports each step as it ends",
                                      Number(0, 3600, unit="seconds"), default=5.0)
    forks: int = common("forks")
    revision: str | None = option("The model repo at this branch, tag or commit (default: the recipe's, else main)",
                                  Revision())
    include: list[str] | None = option("Stage only the model repo's files matching these patterns, comma-separated, "
                                       "as hf download --include takes them (e.g. '*.safetensors,*.json')",
                                       PATH_PATTERN)
    exclude: list[str] | None = option("Leave out the model repo's files matching these patterns, comma-separated "
                                       "(e.g. 'original/*')", PATH_PATTERN)


@command(StageOptions)
def stage_weights(c, o: StageOptions):
    """Stage a model's weights into every host's store: download once, fan out over the fabric, verify."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays import stage as plays

    out = sys.stderr if o.json else sys.stdout
    with user_errors():
        model = model_argument(o.model)
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        report = Report(out, quiet=o.json)
        summary = plays.run_stage(inv, targets, model, plays.StageOptions(
            check=o.check, rehash=o.rehash, source=o.source, streams=o.streams, image=o.image,
            accept_new_host_keys=o.accept_new_host_keys, forks=o.forks, revision=o.revision, include=o.include,
            exclude=o.exclude), report)
        src = summary["source"]
    print_report(report, o.json, stage=summary)
    if not o.json:
        print(f"\n{model}: {summary['files']} files, {_h(summary['bytes'])}; source {src}; "
              f"{summary['seconds']:.1f}s" + (" (check: nothing transferred)" if o.check else ""))
    finish(report.exit_code())


def model_argument(model: str) -> str:
    """The MODEL argument: an alias, or ORG/NAME[@REVISION] whose revision is checked as
    --revision's is (it went to the hub unchecked)."""
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
