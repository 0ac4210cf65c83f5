"""Model integrations: third-party model code running on fcp's operators.

* :mod:`fcp.integrations.hf` - transformers models (GLM-5.3-Flash, Kimi-Linear, Qwen3-Next) by
  in-place mixer replacement; :mod:`fcp.integrations.hf.models` lists the supported mixers and
  is where a new model's adapter goes.
"""
