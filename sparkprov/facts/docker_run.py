"""A `docker run` that fails says why: docker's cause line, not its last line.

On a failed run docker prints the cause, then a usage hint (the docker 28 client, the lab's and a
Spark's, as captured in tests/fixtures/docker/run-125-*.txt):

    Unable to find image 'prom/prometheus:v3.5.0' locally
    docker: Error response from daemon: Get "http://10.77.0.1:5000/v2/": ...

    Run 'docker run --help' for more information

(older clients: "See 'docker run --help'."). A failed step is reported by the last line it printed
on stderr, so `invoke monitor up` on a host without the image said only the hint (issue 36). Every
`docker run` whose failure sparkprov reports goes through `reporting_cause`: docker's stderr passes
through as it was, and on a failure one line follows it, last, naming docker's exit status and its
cause: the `docker: ...` line (the daemon's refusal, exit 125; a command the image lacks, 126/127),
else the last line that is not the usage hint (the program in the container failed on its own).
"""

from __future__ import annotations

from sparkprov.transport.shell import quote

# the line docker starts its own error with; the usage hint it ends with (both clients' wordings)
CAUSE_PREFIX = "docker: "
HINTS = ("See 'docker ", "Run 'docker ")
FAILED = "docker run failed"


def reporting_cause(run: str) -> str:
    """POSIX sh: a command group running the command line `run` (its words quoted; its stdin and
    stdout as the caller redirects the group), whose stderr passes through; when it fails, a last line
    `docker run failed (exit N): CAUSE` on stderr, and the group's status is docker's. Under the
    engine's `set -e` a failure ends the step as the bare command would; inside `$(...)` it can be
    written right after the parenthesis (a group, not a subshell: `$((` would be arithmetic)."""
    hints = " ".join(f"-e {quote('^' + h)}" for h in HINTS)
    return ("{ __dr_e=$(mktemp) || __dr_e=/tmp/sparkprov-docker-run.$$\n"
            "__dr_rc=0\n"
            f'{run} 2>"$__dr_e" || __dr_rc=$?\n'
            'cat "$__dr_e" >&2\n'
            'if [ "$__dr_rc" != 0 ]; then\n'
            f'  __dr_c=$(grep -m 1 {quote("^" + CAUSE_PREFIX)} "$__dr_e" || grep -v {hints} -e "^[[:space:]]*$" "$__dr_e" '
            "| tail -n 1)\n"
            f'  echo "{FAILED} (exit $__dr_rc): ${{__dr_c:-it printed nothing}}" >&2\n'
            "fi\n"
            'rm -f "$__dr_e"\n'
            '(exit "$__dr_rc"); }')


def cause_of(text: str) -> str | None:
    """The line `reporting_cause` printed for a failed run, from what the step printed (stdout and
    stderr together, as a module that captures both reads them), or None."""
    lines = [line for line in text.splitlines() if line.startswith(FAILED + " (exit ")]
    return lines[-1] if lines else None

