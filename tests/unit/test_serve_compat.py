"""The model name's revision split as the installed transformers' server splits it, with and
without its ``split_revision`` (added after 5.17, whose loader split at the first ``@``)."""

from __future__ import annotations

import pytest

serving_utils = pytest.importorskip("transformers.cli.serving.utils")

from hf_paged.integrations.serve_compat import split_revision  # noqa: E402


@pytest.mark.parametrize("name, expected", [
    ("org/model@main", ("org/model", "main")),
    ("org/model@dev", ("org/model", "dev")),
    ("org/model", ("org/model", None)),
])
def test_without_transformers_split_revision(monkeypatch, name, expected):
    monkeypatch.delattr(serving_utils, "split_revision", raising=False)
    assert split_revision(name) == expected


def test_with_transformers_split_revision(tmp_path):
    if not hasattr(serving_utils, "split_revision"):
        pytest.skip("this transformers has no split_revision")
    local = tmp_path / "ckpt@1000"
    local.mkdir()
    for name in ("org/model@dev", "org/model", str(local)):
        assert split_revision(name) == serving_utils.split_revision(name)
