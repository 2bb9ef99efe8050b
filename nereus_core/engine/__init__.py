"""The device-side code: the functions the device actors run on their slots.

Forward passes and Nereus's own KV-cache sampler (``forward.py``: one of the two rollout engines;
the other is vLLM, ``tasks/runtime/vllm_engine.py``), what a rollout engine is asked and how its
answers become tensors (``sampling.py``), training steps (``train.py``, around DeepSpeed's engine),
the exchange of tensor slices between ranks (``exchange.py``), resharding and weight sync. The
package's name is older than the word "rollout engine": nothing here decides what runs where.
"""
