"""vLLM as the replica's engine (``engine="vllm"``), with our eviction policy inside it.

Modules: ``config`` (tunables -> vLLM engine args), ``engine`` (``VLLMEngine``, the
``ServingEngine`` over ``AsyncLLM``), ``scheduler`` (``UniCacheScheduler``, run by vLLM in
its engine-core process), ``free_queue`` (``PolicyFreeQueue``, the policy-ordered free-block
queue), ``kv_events`` (vLLM's KV events -> ours), ``status`` (pool snapshots to the replica),
``request_meta`` (class and salt as vLLM carries them), ``version`` (the pinned release).

Nothing here is imported unless the vllm engine is chosen: vLLM is an optional extra.
"""
