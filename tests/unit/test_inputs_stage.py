"""stage-weights at the door (issue 24): a gated catalog model without a token is said to be gated
(with the fix: HF_TOKEN) before the hub is asked, so a hub that is down cannot hide it behind
"cannot be reached"; ORG/NAME@REV gets the revision check --revision gets. Through the real task,
the hub and the hosts at addresses nothing listens on (port 9)."""


import pytest
from invoke import Context

from sparkprov.cli.cluster import cluster_up
from sparkprov.cli.stage import stage_weights

from helpers import refused

DOWN = "http://127.0.0.1:9"  # a hub that is down: nothing listens there


@pytest.fixture
def inv(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    path = tmp_path / "inventory.yaml"
    path.write_text(f"defaults: {{port: 9, connect_timeout: 1}}\nhosts:\n  s1: {{address: 127.0.0.1}}\n"
                    f"  s2: {{address: 127.0.0.1}}\nvars:\n  hf_endpoint: {DOWN}\n")
    return str(path)


def test_gated_catalog_model_without_a_token_says_gated_not_unreachable(inv):
    msg = refused(lambda: stage_weights(Context(), "llama-3.3-70b", inventory=inv, check=True))
    assert msg == ("llama-3.3-70b: meta-llama/Llama-3.3-70B-Instruct is gated and no Hugging Face token was found; "
                   f"nothing was contacted (fix: accept the license on {DOWN}/meta-llama/Llama-3.3-70B-Instruct, "
                   "then set HF_TOKEN or run `hf auth login` on this machine (sparkprov passes the token to the "
                   "downloading host))")


def test_cluster_up_stage_of_a_gated_model_without_a_token_too(inv):
    msg = refused(lambda: cluster_up(Context(), model="llama-3.3-70b", tp=2, stage=True, inventory=inv, check=True))
    assert "is gated and no Hugging Face token was found" in msg and "HF_TOKEN" in msg, msg


def test_an_open_model_still_asks_the_hub(inv):
    """Not gated: the hub is asked, and the one at DOWN cannot be reached (the check above is the
    catalog's knowledge, not a refusal of every model without a token)."""
    msg = refused(lambda: stage_weights(Context(), "org/open-model", inventory=inv, check=True))
    assert "cannot be reached" in msg, msg


@pytest.mark.parametrize("model,words", [
    ("org/name@bad..rev", "'bad..rev' is not a branch, tag or commit"),
    ("org/name@x;id", "'x;id' is not a branch, tag or commit"),
    ("org/name@-rf", "'-rf' is not a branch, tag or commit"),
    ("org/name@main\n", "control characters"),
    ("org/name@", "a revision follows ORG/NAME after '@'"),
    ("llama-3.3-70b@main", "a revision follows ORG/NAME after '@'"),
])
def test_org_name_at_revision_is_checked_like_revision(inv, model, words):
    msg = refused(lambda: stage_weights(Context(), model, inventory=inv, check=True))
    assert f"{model!r}: " in msg and words in msg, msg
