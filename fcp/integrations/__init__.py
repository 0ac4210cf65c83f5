"""Model integrations: third-party model code running on fcp's operators.

* :mod:`fcp.integrations.hf` - transformers' hybrid models (KDA, Gated DeltaNet, Mamba2 and
  short-conv hybrids; the list is its ``SUPPORTED``) by in-place mixer replacement;
  :mod:`fcp.integrations.hf.models` maps the supported mixers to fcp's and is where a new
  model's adapter goes.
"""
