"""What lightning-vlm adds around vLLM's own OpenAI-compatible server (a vLLM endpoint plugin).

vLLM serves generation (``/v1/chat/completions``), health, its RL and dev endpoints and ``--api-key``
on ``/v1``. This package adds, in the same app: a weight update that is checked before the engine is
touched (a bad update cannot wedge it), authentication of every route when a key is set, and request
body limits. ``lightning_vlm.serve`` launches vLLM's server with it; ``vllm serve`` loads it with
``VLLM_PLUGINS=lightning_vlm``.
"""
