"""Device side: the model runner, tensor-parallel ranks and the executor that drives them."""
