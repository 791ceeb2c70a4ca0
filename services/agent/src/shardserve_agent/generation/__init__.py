"""Generation on one rank: steps over the KV cache, decode runs, the cache's budget."""
