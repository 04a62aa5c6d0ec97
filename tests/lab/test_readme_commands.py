"""The README's example commands, read from README.md itself, each run on the demo lab with the
inventory as shipped (issue 36: a newcomer's first command, `invoke provision --hosts spark1,spark2`
after `make demo`, failed on the lab's rail figures; `nccl-check` hung; `monitor up` and `gateway up`
failed with docker's exit 125).

Which commands: every `invoke ...` line of a code block and every `invoke ...` of a table's first
column. A `(lab: ...)` note beside one says how it runs on the lab: `lab: invoke ...` (the lab's form
of it: lab-tiny for a placeholder or a catalog model, the Gloo backend for nccl-check; several
separated by `;`), `lab: exit N: WHY` (it exits N there) or `lab: not run, WHY`. Without a note an example
runs as written, `[optional]` parts left out and each `a|b` alternative on its own, and exits 0.

"The demo lab" is what `make demo` leaves: the lab's hosts, every image of the lab registry
(sparklab/image.py lab_images), lab-tiny staged and serving TP 2 on spark1 and spark2 (the native
executor), the lab's token as HF_TOKEN. Here the session's lab gets the images, and the README's own
first commands make the rest (provision, stage-weights, and cluster-up in its lab form: what `make
demo` runs): no step is done twice. They run in the README's order, `cluster-down` last; each in a
fresh folder (what they write stays out of the checkout) with the repository's tasks.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
INVOKE = str(REPO / ".venv" / "bin" / "invoke")
NOTE = re.compile(r"\(lab: ((?:[^()`]|`[^`]*`)+)\)")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*(?:/[A-Z][A-Z0-9_]*)?\b")
LAST = ("invoke cluster-down",)   # after every other: the commands before it read the deployment
# Commands that change nothing on the hosts (they read, or contact none): consecutive ones run at once.
READS = re.compile(r"^invoke (facts|history|status|guard|plan|models|recipe|lint|images|lab\.status|monitor write)\b"
                   r"|^invoke store(?!.*--prune)|^invoke \S+ .*--check\b")


@dataclass
class Example:
    line: int
    text: str                      # as the README writes it
    note: str = ""                 # the words of its `(lab: ...)` note
    runs: list[str] = field(default_factory=list)   # the command lines run on the lab
    exit: int = 0
    skipped: str = ""              # why it is not run on the lab


def _note_items(note: str) -> list[str]:
    """The items of a note, `;` between them; an item that starts with a `command` is that command (what
    follows it says why)."""
    out = []
    for item in (x.strip() for x in note.split(";")):
        m = re.match(r"`([^`]+)`", item)
        if m:
            out.append(m.group(1).strip())
        elif item:
            out.append(item)
    return out


def example(line: int, text: str, note: str) -> Example:
    ex = Example(line, text.strip(), note)
    forms = []
    for item in _note_items(note):
        if item.startswith("invoke "):
            forms.append(item)
        elif re.match(r"exit \d+\b", item):
            ex.exit = int(item.split()[1].rstrip(":,"))
        elif item.startswith("not run"):
            ex.skipped = item
        else:
            raise ValueError(f"README.md:{line}: a lab note says {item!r}: `invoke ...`, `exit N` or `not run, WHY`")
    if ex.skipped:
        return ex
    if forms:
        ex.runs = forms
        return ex
    bare = re.sub(r"\s*\[[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*\]", "", ex.text)  # optional parts (nested too)
    words = bare.split()
    alternatives = [i for i, w in enumerate(words) if "|" in w and not w.startswith(("'", '"'))]
    if alternatives:
        i = alternatives[0]
        ex.runs = [" ".join(words[:i] + [alt] + words[i + 1:]) for alt in words[i].replace("\\|", "|").split("|")]
    else:
        ex.runs = [bare]
    return ex


def examples(text: str) -> list[Example]:
    """Every example of README.md, in its order."""
    out: list[Example] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if (fenced or line.startswith("    ")) and line.strip().startswith("invoke "):
            command, _, comment = line.strip().partition("  #")
            m = NOTE.search(comment)
            out.append(example(n, command, m.group(1) if m else ""))
        elif line.startswith("| `invoke"):
            cell = line.replace("\\|", "\0").split("|")[1].replace("\0", "|")
            for part in cell.split(" / "):
                m = NOTE.search(part)
                bare = NOTE.sub("", part)
                for seg in re.findall(r"`([^`]+)`", bare):
                    out.append(example(n, seg if seg.startswith("invoke") else "invoke " + seg,
                                       m.group(1) if m else ""))
    return out


def plan(exs: list[Example]) -> list[tuple[str, Example]]:
    """The command lines to run, each once, in the README's order with LAST at the end."""
    seen: set[str] = set()
    first: list[tuple[str, Example]] = []
    last: list[tuple[str, Example]] = []
    for ex in exs:
        for run in ex.runs:
            if run in seen:
                continue
            seen.add(run)
            (last if run in LAST else first).append((run, ex))
    return first + last


def test_every_readme_example_is_read_and_runs_or_says_why_not():
    """No lab: what the README gives. Its first example is a newcomer's first command, as written."""
    exs = examples(README.read_text())
    assert exs[0].text == "invoke provision --hosts spark1,spark2" and exs[0].runs == [exs[0].text]
    assert len(exs) >= 30, [e.text for e in exs]
    for ex in exs:
        if ex.skipped:
            assert len(ex.skipped) > len("not run, "), f"README.md:{ex.line}: {ex.text}: say why it is not run"
            continue
        for run in ex.runs:
            left = [w for w in PLACEHOLDER.findall(run) if not w.startswith(("GB", "MB"))]
            assert not left, f"README.md:{ex.line}: {run!r} has placeholders {left}: give its lab form beside it"
            shlex.split(run)  # one command line a shell reads


def pull_demo_image(lab) -> None:
    """lab-tiny's image on every host, pulled at once (make demo pulls it beside its steps)."""
    from sparkprov.catalog.load import load_catalog

    image = load_catalog().get("lab-tiny").image
    with ThreadPoolExecutor(len(lab.names)) as pool:
        for h, r in zip(lab.names, pool.map(lambda h: lab.exec(h, ["docker", "pull", "-q", image], check=False,
                                                                   timeout=900), lab.names)):
            assert r.returncode == 0, (h, r.stderr)


def test_every_readme_example_exits_as_the_readme_says_on_the_demo_lab(lab, tmp_path):
    from sparklab.hub import ensure_lab_hub, lab_token
    from sparklab.image import ensure_images, lab_images
    from sparklab.state import BRIDGE_IP, HUB_PORT, REGISTRY_PORT

    t0 = time.monotonic()
    ensure_lab_hub(lab.state_dir, BRIDGE_IP, HUB_PORT)                  # the lab hub, as make demo runs it
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", lab_images())   # the lab registry as make demo leaves it
    pull_demo_image(lab)                                                 # and both hosts as it leaves them
    env = {k: v for k, v in os.environ.items() if k not in ("SPARKPROV_INVENTORY",)}
    env.update({"HF_TOKEN": lab_token(lab.state_dir), "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"})
    timings, wrong = [f"images pushed: {time.monotonic() - t0:.1f}s"], []

    def one(item: tuple[int, str, Example]) -> tuple[str, str | None]:
        n, run, ex = item
        here = tmp_path / f"{n:02d}-l{ex.line}"
        here.mkdir()
        for name in ("playbooks", "tests"):  # the README's paths, as from the checkout's root
            (here / name).symlink_to(REPO / name)
        argv = run.replace("invoke ", f"{INVOKE} -r {REPO} ", 1)
        t = time.monotonic()
        p = subprocess.run(["sh", "-c", argv], cwd=here, env=env, capture_output=True, text=True, timeout=900)
        line = f"{time.monotonic() - t:6.1f}s  exit {p.returncode}  README.md:{ex.line}  {run}"
        if p.returncode == ex.exit:
            return line, None
        tail = (p.stdout[-1500:] + "\n" + p.stderr[-1500:]).strip()
        return line, f"README.md:{ex.line}: `{run}` exited {p.returncode}, the README says {ex.exit}:\n{tail}"

    batch: list[tuple[int, str, Example]] = []

    def flush() -> None:
        with ThreadPoolExecutor(max_workers=4) as pool:
            for line, bad in pool.map(one, batch):
                timings.append(line)
                wrong.extend([bad] if bad else [])
        batch.clear()

    for n, (run, ex) in enumerate(plan(examples(README.read_text()))):
        if not READS.search(run):
            flush()
        batch.append((n, run, ex))
        if not READS.search(run):
            flush()
    flush()
    print("\n[readme] " + "\n[readme] ".join(timings) + f"\n[readme] all: {time.monotonic() - t0:.0f}s")
    assert not wrong, "\n\n".join(wrong)
