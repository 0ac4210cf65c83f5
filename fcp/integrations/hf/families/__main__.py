"""``python -m fcp.integrations.hf.families [table | list]``: print the transformers guide's model
table (``table``, the default: what goes between the ``<!-- families:begin -->`` and ``<!--
families:end -->`` markers of ``docs/guides/transformers.md``) or the README's list of families
(``list``: between the same markers in ``README.md``)."""

import sys

from fcp.integrations.hf.families import model_list, model_table


def main(argv: list[str]) -> None:
    what = argv[0] if argv else "table"
    if what not in ("table", "list"):
        sys.exit(f"usage: python -m fcp.integrations.hf.families [table | list], got {what!r}")
    print(model_table() if what == "table" else model_list(), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
