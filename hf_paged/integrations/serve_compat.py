"""transformers' serving helpers that its versions name differently, behind one name each."""

from __future__ import annotations


def split_revision(model_id_and_revision: str) -> tuple[str, str | None]:
    """``"org/model@rev"`` -> ``("org/model", "rev")`` by the installed transformers' rule: its
    own ``split_revision`` where it has one (it keeps an ``@`` inside an existing local path);
    before it (5.17 and earlier), its loader split the name at the first ``@``, which its
    ``process_model_name`` had appended."""
    try:
        from transformers.cli.serving.utils import split_revision as stock
    except ImportError:
        model_id, _, revision = model_id_and_revision.partition("@")
        return model_id, revision or None
    return stock(model_id_and_revision)
