"""Model integrations: third-party model code running on fcp's operators.

* :mod:`fcp.integrations.hf` - transformers' hybrid models (KDA, Gated DeltaNet, Mamba2 and
  short-conv hybrids) by in-place mixer replacement; :mod:`fcp.integrations.hf.families` is the
  registry of the supported families (one module and one row per family, where a new model's
  adapters go), :mod:`fcp.integrations.hf.mixers` the mixer kinds they build on.
"""
