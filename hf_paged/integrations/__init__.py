"""hf_paged behind transformers' own interfaces: the model object and the patch."""
