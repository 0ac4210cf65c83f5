"""``python -m fcp.integrations.hf.families``: print the README's model table (what goes between
its ``<!-- families:begin -->`` and ``<!-- families:end -->`` markers)."""

from fcp.integrations.hf.families import model_table

print(model_table(), end="")
