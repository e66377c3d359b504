from hf_paged.modeling.swap import PagedQwen3 as PagedModel  # noqa: F401
