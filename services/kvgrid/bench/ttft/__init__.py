"""``kvgrid bench ttft``: an engine harness that measures time to first token with the connector.

``model`` is the model (a Llama-shaped decoder over a paged KV cache in vLLM's layout), ``engine``
drives vLLM's scheduler and ``KVGridConnector``'s worker half around it in the model runner's
order, ``tp`` runs it with tensor parallelism (one process, shard and agent per rank), ``bench``
times misses, hits and their limits in one run and prints the ratios.
"""
