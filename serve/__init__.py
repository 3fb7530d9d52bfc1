"""The serving engines this toolkit drives: the real vLLM, in its own virtualenv (vllm_engine starts vllm_worker there).
Reads the family registry (models/families.py); eval/ and data/ call it."""
