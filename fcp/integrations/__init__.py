"""Model integrations: third-party model code running on fcp's operators.

* :mod:`fcp.integrations.hf` - transformers models (GLM-5.3-Flash) by module replacement.
"""
